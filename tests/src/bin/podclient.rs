//! A pod's client process for the two-node lab: joins the pod's cgroup (below its node's,
//! where the agent attached the socket hooks, as the DaemonSet's root-cgroup placement puts
//! every pod) and network namespace, then talks to a service. A thread of the test process
//! cannot stand in for it: a socket belongs to the cgroup of the process that made it.
//!
//! Prints a line per exchange: `OK <pod> <peer> <port> <bytes>` (the backend's greeting,
//! and the size of a UDP answer) or `ERR <errno> <elapsed ms> <message>`.

use std::{
    fs::File,
    io::{BufRead, BufReader, Write},
    net::{IpAddr, SocketAddr, TcpStream, UdpSocket},
    os::fd::AsRawFd,
    path::PathBuf,
    time::{Duration, Instant},
};

use clap::{Parser, Subcommand};

// The clients' source, not the test library: see its module doc.
#[path = "../client.rs"]
mod client;

#[derive(Debug, Parser)]
#[command(name = "podclient")]
struct Args {
    /// The pod's network namespace (a name under /var/run/netns).
    #[arg(long)]
    netns: String,
    /// The pod's cgroup v2 directory (without it: the parent's cgroup, for a client outside
    /// every pod's, as connbench's tc-path series).
    #[arg(long)]
    cgroup: Option<PathBuf>,
    #[command(subcommand)]
    what: What,
}

#[derive(Debug, Subcommand)]
enum What {
    /// `count` exchanges, each on a new socket.
    Hello {
        #[arg(value_parser = ["tcp", "udp", "sctp"])]
        transport: String,
        to: SocketAddr,
        count: usize,
        #[arg(long)]
        source: Option<IpAddr>,
        #[arg(long, default_value_t = 3000)]
        timeout_ms: u64,
        /// UDP payload size.
        #[arg(long, default_value_t = 10)]
        size: usize,
    },
    /// `count` sequential TCP connections (connect, read the greeting, close): prints each
    /// connect's time in µs, then `TOTAL <seconds>` (for connbench).
    Bench { to: SocketAddr, count: usize },
    /// One TCP connection held open: prints the greeting, then echoes each line of stdin
    /// through it (the backend echoes) until stdin ends, which closes it.
    Session { to: SocketAddr },
    /// One connected UDP socket: a datagram every `every_ms`, for `for_ms`; one line per
    /// answer (`-` for none). A socket the kernel ended is replaced, as a resolver does.
    UdpLoop {
        to: SocketAddr,
        #[arg(long, default_value_t = 50)]
        every_ms: u64,
        #[arg(long)]
        for_ms: u64,
    },
}

fn main() {
    let args = Args::parse();
    if let Err(e) = enter(&args) {
        eprintln!("podclient: {e}");
        std::process::exit(2);
    }
    let out = std::io::stdout();
    let mut out = out.lock();
    match args.what {
        What::Hello {
            transport,
            to,
            count,
            source,
            timeout_ms,
            size,
        } => {
            let Some(how) = client::Transport::parse(&transport) else {
                eprintln!("podclient: {transport}: not tcp, udp or sctp");
                std::process::exit(2);
            };
            let timeout = Duration::from_millis(timeout_ms);
            for hello in client::hellos(how, to, source, count, size, timeout) {
                let line = match hello {
                    Ok((h, n)) => format!("OK {} {} {} {n}", h.pod, h.from, h.port),
                    Err((e, took)) => format!(
                        "ERR {} {} {e}",
                        e.raw_os_error().unwrap_or(0),
                        took.as_millis()
                    ),
                };
                let _ = writeln!(out, "{line}");
            }
        }
        What::Session { to } => session(&mut out, to),
        What::Bench { to, count } => {
            let started = Instant::now();
            for _ in 0..count {
                let t = Instant::now();
                let Ok(stream) = TcpStream::connect_timeout(&to, Duration::from_secs(2)) else {
                    let _ = writeln!(out, "ERR");
                    return;
                };
                let connect_us = t.elapsed().as_secs_f64() * 1e6;
                let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
                let mut line = String::new();
                if BufReader::new(&stream).read_line(&mut line).is_err() {
                    let _ = writeln!(out, "ERR");
                    return;
                }
                let _ = writeln!(out, "{connect_us:.1}");
            }
            let _ = writeln!(out, "TOTAL {}", started.elapsed().as_secs_f64());
        }
        What::UdpLoop {
            to,
            every_ms,
            for_ms,
        } => udp_loop(&mut out, to, every_ms, for_ms),
    }
}

fn session(out: &mut impl Write, to: SocketAddr) {
    let started = Instant::now();
    let stream = match TcpStream::connect_timeout(&to, Duration::from_secs(2)) {
        Ok(s) => s,
        Err(e) => {
            let _ = writeln!(
                out,
                "ERR {} {} {e}",
                e.raw_os_error().unwrap_or(0),
                started.elapsed().as_millis()
            );
            return;
        }
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let mut reader = BufReader::new(&stream);
    let mut line = String::new();
    let _ = match reader.read_line(&mut line) {
        Ok(_) => writeln!(out, "OK {}", line.trim()),
        Err(e) => writeln!(out, "ERR {} 0 {e}", e.raw_os_error().unwrap_or(0)),
    };
    let _ = out.flush();
    for msg in std::io::stdin().lines() {
        let Ok(msg) = msg else { break };
        let mut echo = String::new();
        let reply = (&stream)
            .write_all(format!("{msg}\n").as_bytes())
            .and_then(|_| reader.read_line(&mut echo));
        let _ = match reply {
            Ok(_) => writeln!(out, "OK {}", echo.trim()),
            Err(e) => writeln!(out, "ERR {} 0 {e}", e.raw_os_error().unwrap_or(0)),
        };
        let _ = out.flush();
    }
}

/// Joins the cgroup first (sockets take the cgroup of the process that creates them), then
/// the network namespace.
fn enter(args: &Args) -> std::io::Result<()> {
    if let Some(cgroup) = &args.cgroup {
        std::fs::write(cgroup.join("cgroup.procs"), "0")?;
    }
    let ns = File::open(format!("/var/run/netns/{}", args.netns))?;
    // SAFETY: setns on a descriptor we hold, in a process with one thread.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn udp_loop(out: &mut impl Write, to: SocketAddr, every_ms: u64, for_ms: u64) {
    let connect = || -> std::io::Result<UdpSocket> {
        let any = if to.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
        let s = UdpSocket::bind(any)?;
        s.connect(to)?;
        s.set_read_timeout(Some(Duration::from_millis(200)))?;
        Ok(s)
    };
    let end = Instant::now() + Duration::from_millis(for_ms);
    let mut socket = connect().ok();
    let mut buf = [0u8; 512];
    while Instant::now() < end {
        let who = match &socket {
            Some(s) => match s.send(b"ping").and_then(|_| s.recv(&mut buf)) {
                Ok(n) => String::from_utf8_lossy(&buf[..n])
                    .split_whitespace()
                    .next()
                    .unwrap_or("")
                    .to_string(),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => "-".into(),
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => "-".into(),
                // Ended (ECONNABORTED) or refused: a new socket, as a resolver retries.
                Err(_) => {
                    socket = None;
                    "-".into()
                }
            },
            None => {
                socket = connect().ok();
                "-".into()
            }
        };
        let _ = writeln!(out, "{who}");
        let _ = out.flush();
        std::thread::sleep(Duration::from_millis(every_ms));
    }
}
