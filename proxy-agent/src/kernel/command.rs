//! Running the node's tools (`iptables-restore`, `nft`, `ipset`, ...): with a timeout, and
//! always reaped.
//!
//! A tool that hangs (a wedged xtables lock holder, a kernel stuck on a huge ruleset) must not
//! stop the sync loop for good: past its timeout it is killed, and the sync fails with the
//! command named, to be retried. A tool that exits before reading its input (a bad flag, a
//! missing module) must not leave a zombie behind: the writer's broken pipe is not an early
//! return, the exit status is always collected, and it is the error reported.

use std::{
    io::{Read, Write},
    os::unix::process::CommandExt,
    process::{Command, ExitStatus, Stdio},
    sync::mpsc,
    time::Duration,
};

use anyhow::{anyhow, Context, Result};

/// For a quick question (`--version`, a probe): a healthy tool answers in milliseconds.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(30);
/// For anything that reads or writes a ruleset: `nft` takes minutes over 100 000 services'
/// chains, so this bounds a hang without failing a large but healthy sync.
pub const RULESET_TIMEOUT: Duration = Duration::from_secs(600);

/// What a finished command gave.
#[derive(Debug)]
pub struct Output {
    pub pid: u32,
    pub status: ExitStatus,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// Runs `command` with `input` on its standard input (none: `/dev/null`), collecting its
/// output; kills it past `timeout`. The child is waited for on every path.
pub fn run(command: &mut Command, input: Option<&[u8]>, timeout: Duration) -> Result<Output> {
    let program = command.get_program().to_string_lossy().into_owned();
    // Its own process group, so a kill at the timeout reaches whatever it started too (a
    // wrapper's children would otherwise hold the pipes open).
    let mut child = command
        .process_group(0)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {program}"))?;
    let pid = child.id();
    // Each pipe on its own thread: a tool writing much output while we write its input
    // would otherwise deadlock with us.
    let writer = match (child.stdin.take(), input) {
        (Some(mut stdin), Some(input)) => {
            let input = input.to_vec();
            // A broken pipe means the tool exited early: its status says why.
            Some(std::thread::spawn(move || {
                let _ = stdin.write_all(&input);
            }))
        }
        _ => None,
    };
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut out = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut out);
            }
            out
        })
    };
    let stdout = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let stderr = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let (done_tx, done_rx) = mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let _ = done_tx.send(child.wait());
    });
    let (status, timed_out) = match done_rx.recv_timeout(timeout) {
        Ok(status) => (status, false),
        Err(_) => match done_rx.try_recv() {
            // It ended just now: no kill (its pid may already be another's).
            Ok(status) => (status, false),
            Err(_) => {
                // Still running: the waiter has not reaped it, so its pid (and group) are
                // still its own.
                // SAFETY: sending a signal to a process group has no memory effects.
                unsafe { libc::kill(-(pid as libc::pid_t), libc::SIGKILL) };
                (
                    done_rx
                        .recv()
                        .map_err(|_| anyhow!("{program}: its waiter went away"))?,
                    true,
                )
            }
        },
    };
    let _ = waiter.join();
    if let Some(w) = writer {
        let _ = w.join();
    }
    let stdout = stdout.join().unwrap_or_default();
    let stderr = stderr.join().unwrap_or_default();
    let status = status.with_context(|| format!("waiting for {program}"))?;
    if timed_out {
        return Err(anyhow!(
            "{program} (pid {pid}) did not finish within {:.1}s and was killed",
            timeout.as_secs_f64()
        ));
    }
    Ok(Output {
        pid,
        status,
        stdout,
        stderr,
    })
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    /// No child of this process is left to reap (no zombie).
    fn no_child_left(pid: i32) -> bool {
        // SAFETY: WNOHANG never blocks; the status pointer may be null.
        let r = unsafe { libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG) };
        r == -1 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD)
    }

    #[test]
    fn output_and_status_are_collected_with_large_input_and_output() {
        let input = vec![b'x'; 4 << 20];
        let out = run(&mut Command::new("cat"), Some(&input), PROBE_TIMEOUT).unwrap();
        assert!(out.status.success());
        assert_eq!(out.stdout.len(), input.len(), "no deadlock on full pipes");
    }

    #[test]
    fn a_tool_that_exits_before_reading_its_input_is_reaped_and_its_status_reported() {
        let input = vec![b'x'; 4 << 20];
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo bad flag >&2; exit 3"]);
        let out = run(&mut cmd, Some(&input), PROBE_TIMEOUT).unwrap();
        assert_eq!(out.status.code(), Some(3));
        assert_eq!(String::from_utf8_lossy(&out.stderr).trim(), "bad flag");
        assert!(no_child_left(out.pid as i32), "left unreaped");
    }

    #[test]
    fn a_hung_tool_is_killed_at_the_timeout_and_reaped() {
        let started = Instant::now();
        let mut cmd = Command::new("sleep");
        cmd.arg("30");
        let err = run(&mut cmd, None, Duration::from_millis(300))
            .unwrap_err()
            .to_string();
        assert!(err.contains("did not finish within 0.3s"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(10));
        let pid: i32 = err
            .split("pid ")
            .nth(1)
            .and_then(|r| r.split(')').next())
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no pid in {err}"));
        assert!(no_child_left(pid), "pid {pid} left unreaped");
    }
}
