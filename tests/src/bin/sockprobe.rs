//! What a process sees of its own sockets, for the conformance suite's host-traffic row:
//! `sockprobe udp ADDR:PORT` sends one datagram with sendto on an unconnected socket and
//! prints the source recvfrom reports; `sockprobe tcp ADDR:PORT` connects and prints the
//! peer getpeername reports. Each followed by the backend's greeting.

use std::{
    io::{BufRead, BufReader},
    net::{SocketAddr, TcpStream, UdpSocket},
    time::Duration,
};

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (kind, to) = match args.as_slice() {
        [_, kind, to] => (kind.as_str(), to.parse::<SocketAddr>().expect("ADDR:PORT")),
        _ => {
            eprintln!("usage: sockprobe udp|tcp ADDR:PORT");
            std::process::exit(2);
        }
    };
    match kind {
        "udp" => {
            let any = if to.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
            let s = UdpSocket::bind(any)?;
            s.set_read_timeout(Some(Duration::from_secs(2)))?;
            s.send_to(b"probe", to)?;
            let mut buf = [0u8; 512];
            let (n, from) = s.recv_from(&mut buf)?;
            let text = String::from_utf8_lossy(&buf[..n]);
            println!("from={from} {}", text.lines().next().unwrap_or(""));
        }
        "tcp" => {
            let s = TcpStream::connect_timeout(&to, Duration::from_secs(2))?;
            s.set_read_timeout(Some(Duration::from_secs(2)))?;
            let peer = s.peer_addr()?;
            let mut line = String::new();
            BufReader::new(&s).read_line(&mut line)?;
            println!("peer={peer} {}", line.trim());
        }
        other => {
            eprintln!("unknown kind {other}");
            std::process::exit(2);
        }
    }
    Ok(())
}
