//! The sockets of the userspace proxier, made with `socket2` for the options tokio does not
//! expose.

use std::{
    io,
    net::{IpAddr, SocketAddr},
    os::fd::AsRawFd,
};

use socket2::{Domain, Protocol, Socket, Type};

fn new(addr: SocketAddr, tcp: bool) -> io::Result<Socket> {
    let (kind, protocol) = if tcp {
        (Type::STREAM, Protocol::TCP)
    } else {
        (Type::DGRAM, Protocol::UDP)
    };
    let socket = Socket::new(Domain::for_address(addr), kind, Some(protocol))?;
    socket.set_nonblocking(true)?;
    socket.set_cloexec(true)?;
    Ok(socket)
}

/// A socket bound to a frontend. Service addresses are made local by a route, which the
/// IPv6 stack does not count as an address of the node: free binding lets the socket take
/// them (and IPv4 ones before their route is in place).
fn frontend(addr: SocketAddr, tcp: bool) -> io::Result<Socket> {
    let socket = new(addr, tcp)?;
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
        socket.set_freebind_v6(true)?;
    } else {
        socket.set_freebind_v4(true)?;
    }
    // Connections of an earlier listener in TIME_WAIT must not block binding again.
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    Ok(socket)
}

pub fn listen_tcp(addr: SocketAddr) -> io::Result<tokio::net::TcpListener> {
    let socket = frontend(addr, true)?;
    socket.listen(1024)?;
    tokio::net::TcpListener::from_std(socket.into())
}

pub fn bind_udp(addr: SocketAddr) -> io::Result<tokio::net::UdpSocket> {
    tokio::net::UdpSocket::from_std(frontend(addr, false)?.into())
}

/// A socket towards `endpoint`, leaving from `source` when given (the node's address that
/// masqueraded flows use, as in the other modes) and present on the node.
pub fn upstream(endpoint: SocketAddr, source: Option<IpAddr>, tcp: bool) -> io::Result<Socket> {
    let socket = new(endpoint, tcp)?;
    if let Some(source) = source.filter(|s| s.is_ipv4() == endpoint.is_ipv4()) {
        if tcp {
            // Choose the port at connect, per destination, not at bind: otherwise one
            // source address would run out of ports at ~28 000 connections in total.
            let on: libc::c_int = 1;
            // SAFETY: a valid descriptor and an int option value of the stated size.
            unsafe {
                libc::setsockopt(
                    socket.as_raw_fd(),
                    libc::IPPROTO_IP,
                    libc::IP_BIND_ADDRESS_NO_PORT,
                    (&on as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                );
            }
        }
        // Not on the node (yet): the kernel's choice of source is the fallback.
        let _ = socket.bind(&SocketAddr::new(source, 0).into());
    }
    Ok(socket)
}
