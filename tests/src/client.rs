//! The lab's clients, on std and libc alone: a test thread inside a namespace
//! (`Netns::run`) calls them, and so does `podclient`, a pod's own process, which includes
//! this file instead of linking the whole test library (a small binary starts fast, which
//! matters in the emulated VM).

use std::{
    io::{BufRead, BufReader},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket},
    os::fd::AsRawFd,
    time::Duration,
};

/// Who answered a hello, and what it saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    pub pod: String,
    /// The peer address the backend saw (the client, or the node that source-NATed it).
    pub from: SocketAddr,
    /// The backend's local port.
    pub port: u16,
}

impl Hello {
    pub fn parse(line: &str) -> Option<Self> {
        let mut f = line.split_whitespace();
        Some(Hello {
            pod: f.next()?.to_string(),
            from: f.next()?.parse().ok()?,
            port: f.next()?.parse().ok()?,
        })
    }
}

/// An SCTP one-to-one (stream) socket of `addr`'s family, bound to it (port 0: any);
/// `None` where the kernel has no SCTP. Such a socket is used like a TCP one (connect,
/// listen, accept, read, write), so it is handed out as a `TcpListener`/`TcpStream`.
pub fn sctp_socket(addr: SocketAddr) -> std::io::Result<Option<std::os::fd::OwnedFd>> {
    use std::os::fd::FromRawFd;
    let family = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain socket/setsockopt/bind calls on a fresh descriptor that OwnedFd owns.
    unsafe {
        let fd = libc::socket(
            family,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            libc::IPPROTO_SCTP,
        );
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EPROTONOSUPPORT | libc::ESOCKTNOSUPPORT) => Ok(None),
                _ => Err(e),
            };
        }
        let owned = std::os::fd::OwnedFd::from_raw_fd(fd);
        let one: libc::c_int = 1;
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            &one as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
        if addr.is_ipv6() {
            libc::setsockopt(
                fd,
                libc::IPPROTO_IPV6,
                libc::IPV6_V6ONLY,
                &one as *const _ as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
        let (sa, len) = sockaddr(addr);
        if libc::bind(fd, &sa as *const _ as *const libc::sockaddr, len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Some(owned))
    }
}

/// What a hello runs over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Tcp,
    Udp,
    Sctp,
}

impl Transport {
    /// `tcp`, `udp` or `sctp` (podclient's argument).
    pub fn name(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Udp => "udp",
            Transport::Sctp => "sctp",
        }
    }

    /// The transport [`Transport::name`] names.
    pub fn parse(name: &str) -> Option<Self> {
        [Transport::Tcp, Transport::Udp, Transport::Sctp]
            .into_iter()
            .find(|t| t.name() == name)
    }
}

/// `n` hellos over `how`, each on a new socket (from `source` when given; a UDP datagram of
/// `size` bytes): the greetings with the size of each answer (0 on streams), or the error
/// with how long the failed one took.
pub fn hellos(
    how: Transport,
    to: SocketAddr,
    source: Option<IpAddr>,
    n: usize,
    size: usize,
    timeout: Duration,
) -> Vec<Result<(Hello, usize), (std::io::Error, Duration)>> {
    (0..n)
        .map(|_| {
            let started = std::time::Instant::now();
            match how {
                Transport::Tcp => tcp_hello(to, source, timeout).map(|h| (h, 0)),
                Transport::Udp => udp_hello(to, source, size, timeout),
                Transport::Sctp => sctp_hello(to, source, timeout).map(|h| (h, 0)),
            }
            .map_err(|e| (e, started.elapsed()))
        })
        .collect()
}

/// Connects (from `source` when given), reads the greeting.
pub fn tcp_hello(
    to: impl Into<SocketAddr>,
    source: Option<IpAddr>,
    timeout: Duration,
) -> std::io::Result<Hello> {
    let to: SocketAddr = to.into();
    let mut s = match source {
        None => TcpStream::connect_timeout(&to, timeout)?,
        Some(ip) => {
            let socket = socket_bound(ip, libc::SOCK_STREAM)?;
            let std_socket: std::net::TcpStream = socket.into();
            connect_stream(std_socket, to, timeout)?
        }
    };
    s.set_read_timeout(Some(timeout))?;
    let mut line = String::new();
    BufReader::new(&mut s).read_line(&mut line)?;
    Hello::parse(&line).ok_or_else(|| std::io::Error::other(format!("bad greeting {line:?}")))
}

/// Sends one datagram of `size` bytes (from `source` when given); returns the answer.
pub fn udp_hello(
    to: impl Into<SocketAddr>,
    source: Option<IpAddr>,
    size: usize,
    timeout: Duration,
) -> std::io::Result<(Hello, usize)> {
    let to: SocketAddr = to.into();
    let local: IpAddr = match (source, to) {
        (Some(ip), _) => ip,
        (None, SocketAddr::V4(_)) => Ipv4Addr::UNSPECIFIED.into(),
        (None, SocketAddr::V6(_)) => Ipv6Addr::UNSPECIFIED.into(),
    };
    let s = UdpSocket::bind((local, 0))?;
    s.connect(to)?;
    s.set_read_timeout(Some(timeout))?;
    s.send(&vec![b'x'; size.max(1)])?;
    let mut buf = vec![0u8; 70000];
    let n = s.recv(&mut buf)?;
    let text = String::from_utf8_lossy(&buf[..n]);
    let line = text.lines().next().unwrap_or("");
    let hello = Hello::parse(line)
        .ok_or_else(|| std::io::Error::other(format!("bad greeting {line:?}")))?;
    Ok((hello, n))
}

/// Connects over SCTP (from `source` when given), reads the greeting.
pub fn sctp_hello(
    to: impl Into<SocketAddr>,
    source: Option<IpAddr>,
    timeout: Duration,
) -> std::io::Result<Hello> {
    let to: SocketAddr = to.into();
    let local = source.unwrap_or(match to {
        SocketAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        SocketAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    });
    let fd = sctp_socket(SocketAddr::new(local, 0))?
        .ok_or_else(|| std::io::Error::other("this kernel has no SCTP"))?;
    let mut s = connect_stream(TcpStream::from(fd), to, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    let mut line = String::new();
    BufReader::new(&mut s).read_line(&mut line)?;
    Hello::parse(&line).ok_or_else(|| std::io::Error::other(format!("bad greeting {line:?}")))
}

/// `addr` as a C socket address, with its length.
pub fn sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: an all-zero sockaddr_storage is valid, and it is large and aligned enough
    // for both sockaddr_in and sockaddr_in6.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as _,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*a.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: see above.
            unsafe { std::ptr::write(&mut storage as *mut _ as *mut libc::sockaddr_in, sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as _,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: 0,
            };
            // SAFETY: see above.
            unsafe { std::ptr::write(&mut storage as *mut _ as *mut libc::sockaddr_in6, sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as libc::socklen_t)
}

fn socket_bound(ip: IpAddr, kind: i32) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    let family = if ip.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    let (addr, len) = sockaddr(SocketAddr::new(ip, 0));
    // SAFETY: plain socket/bind calls on a fresh descriptor that OwnedFd then owns.
    unsafe {
        let fd = libc::socket(family, kind | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let owned = std::os::fd::OwnedFd::from_raw_fd(fd);
        if libc::bind(fd, &addr as *const _ as *const libc::sockaddr, len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(owned)
    }
}

fn connect_stream(
    stream: TcpStream,
    to: SocketAddr,
    timeout: Duration,
) -> std::io::Result<TcpStream> {
    let (addr, len) = sockaddr(to);
    stream.set_write_timeout(Some(timeout))?;
    // SAFETY: connect on the stream's own descriptor with a valid socket address. A
    // blocking connect is bounded by the kernel's SYN retries; SO_SNDTIMEO bounds it
    // further.
    let rc = unsafe {
        libc::connect(
            stream.as_raw_fd(),
            &addr as *const _ as *const libc::sockaddr,
            len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(stream)
}
