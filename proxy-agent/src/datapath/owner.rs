//! One agent per bpffs root: an exclusive `flock` on the root directory, held for the
//! process's life, so two agents (or `--cleanup` during a run) never write the same maps and
//! links. The kernel drops the lock when the holder exits, however it exits.
//!
//! A lock says nothing about who holds it, and bpffs holds no regular files, so the holder
//! also records itself as a directory name under `<root>/owner/` (`pid 1234 on node-a`):
//! the one line a refused agent prints names it. A record left by a killed holder is
//! replaced by the next one to take the lock.

use std::{
    fs::{self, File},
    os::fd::AsRawFd,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};

/// The lock, held while this value lives.
#[derive(Debug)]
pub struct RootLock {
    root: PathBuf,
    record: PathBuf,
    _dir: File,
}

/// How this process names itself in the record: pid and host name (in a pod without host
/// networking, the pod's name).
fn this_holder() -> String {
    let host = nix_hostname().unwrap_or_else(|| "an unknown host".to_string());
    format!("pid {} on {host}", std::process::id())
}

fn nix_hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer and its length are valid; gethostname NUL-terminates within it.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return None;
    }
    let end = buf.iter().position(|b| *b == 0)?;
    let name = String::from_utf8_lossy(&buf[..end]).replace('/', "_");
    (!name.is_empty()).then_some(name)
}

fn owner_dir(root: &Path) -> PathBuf {
    root.join("owner")
}

/// Who the records under `root` name (normally one).
fn holders(root: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(owner_dir(root))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

impl RootLock {
    /// Takes the lock on `root` (which must exist), or fails with one line naming the
    /// holder.
    pub fn acquire(root: &Path) -> Result<Self> {
        let dir = File::open(root).with_context(|| format!("opening {}", root.display()))?;
        // SAFETY: a valid descriptor; LOCK_NB makes this return at once.
        if unsafe { libc::flock(dir.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                let holders = holders(root);
                let holder = if holders.is_empty() {
                    "another process".to_string()
                } else {
                    holders.join(", ")
                };
                bail!(
                    "another proxy-agent owns {}: {holder}; stop it first (one agent per node and \
                     bpffs root; --cleanup too waits for the running agent to stop)",
                    root.display()
                );
            }
            return Err(err).with_context(|| format!("locking {}", root.display()));
        }
        let owner = owner_dir(root);
        fs::create_dir_all(&owner).with_context(|| format!("creating {}", owner.display()))?;
        // Records of earlier holders (they are gone: the lock was free).
        for stale in holders(root) {
            let _ = fs::remove_dir(owner.join(stale));
        }
        let record = owner.join(this_holder());
        fs::create_dir(&record).with_context(|| format!("creating {}", record.display()))?;
        Ok(Self {
            root: root.to_path_buf(),
            record,
            _dir: dir,
        })
    }

    /// Removes this holder's record, the empty `owner` directory and the root if it is
    /// empty then, so `--cleanup` leaves nothing behind; the lock itself goes with the value.
    pub fn remove_record(&self) {
        let _ = fs::remove_dir(&self.record);
        let _ = fs::remove_dir(owner_dir(&self.root));
        let _ = fs::remove_dir(&self.root);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_with_the_first_ones_name() {
        let dir = tempfile::tempdir().unwrap();
        let first = RootLock::acquire(dir.path()).unwrap();
        let err = RootLock::acquire(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains(&format!("pid {} on ", std::process::id())),
            "{err}"
        );
        assert!(err.contains("another proxy-agent owns"), "{err}");
        drop(first);
        // Released with the value; the stale record is replaced, not added to.
        let again = RootLock::acquire(dir.path()).unwrap();
        assert_eq!(holders(dir.path()).len(), 1);
        again.remove_record();
        assert!(!dir.path().exists(), "an empty root goes with the record");
    }
}
