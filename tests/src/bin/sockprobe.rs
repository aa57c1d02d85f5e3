//! What a process sees of its own sockets, for the conformance suite's host-traffic row:
//! `sockprobe udp ADDR:PORT` sends one datagram with sendto on an unconnected socket and
//! prints the source recvfrom reports; `sockprobe tcp ADDR:PORT` connects and prints the
//! peer getpeername reports. Each followed by the backend's greeting.

use std::{
    io::{BufRead, BufReader},
    net::{SocketAddr, TcpStream, UdpSocket},
    time::Duration,
};

use clap::{Parser, ValueEnum};

/// What a process sees of its own sockets: the source recvfrom reports (udp) or the peer
/// getpeername reports (tcp), each followed by the backend's greeting.
#[derive(Debug, Parser)]
#[command(name = "sockprobe")]
struct Args {
    /// Which socket to probe with.
    #[arg(value_enum)]
    kind: Kind,
    /// The address to probe (a service's), e.g. 10.96.0.40:53 or [::ffff:10.96.0.42]:80.
    #[arg(value_name = "ADDR:PORT")]
    to: SocketAddr,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Kind {
    /// sendto on an unconnected UDP socket, then print recvfrom's source.
    Udp,
    /// connect a TCP socket, then print getpeername's peer.
    Tcp,
}

fn main() -> std::io::Result<()> {
    let Args { kind, to } = Args::parse();
    match kind {
        Kind::Udp => {
            let any = if to.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
            let s = UdpSocket::bind(any)?;
            s.set_read_timeout(Some(Duration::from_secs(2)))?;
            s.send_to(b"probe", to)?;
            let mut buf = [0u8; 512];
            let (n, from) = s.recv_from(&mut buf)?;
            let text = String::from_utf8_lossy(&buf[..n]);
            println!("from={from} {}", text.lines().next().unwrap_or(""));
        }
        Kind::Tcp => {
            let s = TcpStream::connect_timeout(&to, Duration::from_secs(2))?;
            s.set_read_timeout(Some(Duration::from_secs(2)))?;
            let peer = s.peer_addr()?;
            let mut line = String::new();
            BufReader::new(&s).read_line(&mut line)?;
            println!("peer={peer} {}", line.trim());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn a_kind_and_an_address() {
        Args::command().debug_assert();
        let parse = |args: &[&str]| {
            Args::try_parse_from(std::iter::once("sockprobe").chain(args.iter().copied()))
        };
        let a = parse(&["udp", "10.96.0.40:53"]).unwrap();
        assert!(matches!(a.kind, Kind::Udp));
        assert_eq!(a.to, "10.96.0.40:53".parse().unwrap());
        let a = parse(&["tcp", "[::ffff:10.96.0.42]:80"]).unwrap();
        assert!(matches!(a.kind, Kind::Tcp));
        assert_eq!(a.to, "[::ffff:10.96.0.42]:80".parse().unwrap());
        for bad in [
            &[][..],
            &["udp"],
            &["sctp", "10.0.0.1:1"],
            &["tcp", "10.0.0.1"],
            &["tcp", "10.0.0.1:1", "x"],
            &["--bogus"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }
}
