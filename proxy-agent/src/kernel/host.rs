//! Facts about this host the agent reads or adjusts at start: its local addresses and its
//! open-files limit.

use std::net::{IpAddr, Ipv4Addr};

use tracing::debug;

/// The IPv4 and IPv6 addresses of this network namespace's interfaces.
pub fn local_addresses() -> Vec<IpAddr> {
    let mut found = Vec::new();
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list` with a linked list that freeifaddrs releases; each
    // ifa_addr is checked for null and for AF_INET before being read as a sockaddr_in.
    unsafe {
        if libc::getifaddrs(&mut list) != 0 {
            return found;
        }
        let mut cur = list;
        while !cur.is_null() {
            let addr = (*cur).ifa_addr;
            if !addr.is_null() && (*addr).sa_family as i32 == libc::AF_INET {
                let sin = &*(addr as *const libc::sockaddr_in);
                found.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                    sin.sin_addr.s_addr,
                ))));
            } else if !addr.is_null() && (*addr).sa_family as i32 == libc::AF_INET6 {
                let sin6 = &*(addr as *const libc::sockaddr_in6);
                found.push(IpAddr::V6(sin6.sin6_addr.s6_addr.into()));
            }
            cur = (*cur).ifa_next;
        }
        libc::freeifaddrs(list);
    }
    found
}

/// Raises the soft limit on open files to the hard one, as Go programs such as kube-proxy
/// do at start: the userspace mode holds a listener per service port and two sockets per
/// proxied connection, and a shell's default soft limit (1024) ran out at 1 000 services
/// (every new connection reset).
pub fn raise_open_files_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 || limit.rlim_cur >= limit.rlim_max
        {
            return;
        }
        let wanted = libc::rlimit {
            rlim_cur: limit.rlim_max,
            ..limit
        };
        if libc::setrlimit(libc::RLIMIT_NOFILE, &wanted) == 0 {
            debug!(
                from = limit.rlim_cur,
                to = limit.rlim_max,
                "open files limit raised"
            );
        }
    }
}
