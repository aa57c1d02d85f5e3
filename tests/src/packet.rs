//! Crafting Ethernet/IPv4/TCP/UDP frames and checking them with an independent checksum
//! implementation (RFC 1071), written here from the RFC rather than shared with the datapath,
//! so a checksum bug in the datapath cannot hide behind the same bug in the test.

use std::net::Ipv4Addr;

pub const ETH_HLEN: usize = 14;
pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_ACK: u8 = 0x10;
pub const TCP_FIN: u8 = 0x01;
pub const TCP_RST: u8 = 0x04;

/// RFC 1071 one's-complement sum over `data` (big-endian 16-bit words, odd byte padded).
pub fn ones_complement_sum(data: &[u8]) -> u32 {
    let mut sum = 0u32;
    for chunk in data.chunks(2) {
        let word = if chunk.len() == 2 {
            u16::from_be_bytes([chunk[0], chunk[1]])
        } else {
            u16::from_be_bytes([chunk[0], 0])
        };
        sum += word as u32;
    }
    sum
}

pub fn fold(mut sum: u32) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// The Internet checksum of `data`: the value to store so the whole sums to 0xffff.
pub fn checksum(data: &[u8]) -> u16 {
    !fold(ones_complement_sum(data))
}

fn pseudo_header(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, len: usize) -> Vec<u8> {
    let mut p = Vec::with_capacity(12);
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    p.push(0);
    p.push(proto);
    p.extend_from_slice(&(len as u16).to_be_bytes());
    p
}

/// Checksum of an L4 segment including the IPv4 pseudo-header.
pub fn l4_checksum(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, segment: &[u8]) -> u16 {
    let mut all = pseudo_header(src, dst, proto, segment.len());
    all.extend_from_slice(segment);
    checksum(&all)
}

/// The value offload-capable senders leave in the L4 checksum field (CHECKSUM_PARTIAL):
/// the folded pseudo-header sum, not complemented, for the hardware to complete.
pub fn partial_seed(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, len: usize) -> u16 {
    fold(ones_complement_sum(&pseudo_header(src, dst, proto, len)))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum L4 {
    Tcp { flags: u8, seq: u32, ack: u32 },
    Udp,
}

/// The sequence number of every segment [`PacketSpec::tcp`] builds, both directions alike.
pub const SEQ: u32 = 0x1234_5678;

impl L4 {
    /// A segment with [`SEQ`]; with ACK set it acknowledges a peer that also sent [`SEQ`]
    /// with its SYN (so a test handshake is one a datapath checking sequence numbers
    /// accepts).
    pub fn tcp(flags: u8) -> Self {
        let ack = if flags & 0x10 != 0 {
            SEQ.wrapping_add(1)
        } else {
            0
        };
        L4::Tcp {
            flags,
            seq: SEQ,
            ack,
        }
    }
}

/// A frame to feed the classifier.
#[derive(Clone, Debug)]
pub struct PacketSpec {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub sport: u16,
    pub dport: u16,
    pub l4: L4,
    pub payload: Vec<u8>,
    /// UDP only: send without a checksum (field 0), as UDP over IPv4 allows.
    pub udp_no_checksum: bool,
}

impl PacketSpec {
    pub fn tcp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, flags: u8) -> Self {
        Self {
            src,
            dst,
            sport,
            dport,
            l4: L4::tcp(flags),
            payload: Vec::new(),
            udp_no_checksum: false,
        }
    }

    pub fn udp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, payload: &[u8]) -> Self {
        Self {
            src,
            dst,
            sport,
            dport,
            l4: L4::Udp,
            payload: payload.to_vec(),
            udp_no_checksum: false,
        }
    }

    pub fn proto(&self) -> u8 {
        match self.l4 {
            L4::Tcp { .. } => IPPROTO_TCP,
            L4::Udp => IPPROTO_UDP,
        }
    }

    /// Serialises with correct IPv4 and L4 checksums.
    pub fn build(&self) -> Vec<u8> {
        let (mut segment, csum_at) = segment(self.sport, self.dport, self.l4, &self.payload);
        if !(self.l4 == L4::Udp && self.udp_no_checksum) {
            let mut c = l4_checksum(self.src, self.dst, self.proto(), &segment);
            if self.l4 == L4::Udp && c == 0 {
                c = 0xffff;
            }
            segment[csum_at..csum_at + 2].copy_from_slice(&c.to_be_bytes());
        }

        let total = 20 + segment.len();
        let mut ip = vec![
            0x45,
            0,
            (total >> 8) as u8,
            total as u8,
            0x12,
            0x34,
            0x40,
            0,
            64,
            self.proto(),
            0,
            0,
        ];
        ip.extend_from_slice(&self.src.octets());
        ip.extend_from_slice(&self.dst.octets());
        let c = checksum(&ip);
        ip[10..12].copy_from_slice(&c.to_be_bytes());

        let mut frame = Vec::with_capacity(ETH_HLEN + total);
        frame.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x02]); // dst MAC
        frame.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x01]); // src MAC
        frame.extend_from_slice(&0x0800u16.to_be_bytes());
        frame.extend_from_slice(&ip);
        frame.extend_from_slice(&segment);
        frame
    }
}

/// A TCP or UDP segment with its checksum field zeroed, and where that field is.
fn segment(sport: u16, dport: u16, l4: L4, payload: &[u8]) -> (Vec<u8>, usize) {
    let mut segment = Vec::new();
    segment.extend_from_slice(&sport.to_be_bytes());
    segment.extend_from_slice(&dport.to_be_bytes());
    match l4 {
        L4::Tcp { flags, seq, ack } => {
            segment.extend_from_slice(&seq.to_be_bytes());
            segment.extend_from_slice(&ack.to_be_bytes());
            segment.push(5 << 4); // data offset 5 words
            segment.push(flags);
            segment.extend_from_slice(&64240u16.to_be_bytes()); // window
            segment.extend_from_slice(&[0, 0]); // checksum
            segment.extend_from_slice(&[0, 0]); // urgent
        }
        L4::Udp => {
            let len = 8 + payload.len();
            segment.extend_from_slice(&(len as u16).to_be_bytes());
            segment.extend_from_slice(&[0, 0]);
        }
    }
    segment.extend_from_slice(payload);
    let csum_at = match l4 {
        L4::Tcp { .. } => 16,
        L4::Udp => 6,
    };
    (segment, csum_at)
}

/// IPv6 frames: the same segments in an IPv6 packet (no extension headers), and a parsed
/// view with its own checksum check (the pseudo-header differs from IPv4's).
pub mod ipv6 {
    use std::net::Ipv6Addr;

    use super::{checksum, segment, ETH_HLEN, IPPROTO_TCP, IPPROTO_UDP, L4};

    fn pseudo_header(src: Ipv6Addr, dst: Ipv6Addr, proto: u8, len: usize) -> Vec<u8> {
        let mut p = Vec::with_capacity(40);
        p.extend_from_slice(&src.octets());
        p.extend_from_slice(&dst.octets());
        p.extend_from_slice(&(len as u32).to_be_bytes());
        p.extend_from_slice(&[0, 0, 0, proto]);
        p
    }

    /// A frame to feed the classifier.
    #[derive(Clone, Debug)]
    pub struct PacketSpec6 {
        pub src: Ipv6Addr,
        pub dst: Ipv6Addr,
        pub sport: u16,
        pub dport: u16,
        pub l4: L4,
        pub payload: Vec<u8>,
    }

    impl PacketSpec6 {
        pub fn tcp(src: Ipv6Addr, sport: u16, dst: Ipv6Addr, dport: u16, flags: u8) -> Self {
            let l4 = L4::tcp(flags);
            Self {
                src,
                dst,
                sport,
                dport,
                l4,
                payload: Vec::new(),
            }
        }

        pub fn udp(src: Ipv6Addr, sport: u16, dst: Ipv6Addr, dport: u16, payload: &[u8]) -> Self {
            Self {
                src,
                dst,
                sport,
                dport,
                l4: L4::Udp,
                payload: payload.to_vec(),
            }
        }

        fn proto(&self) -> u8 {
            match self.l4 {
                L4::Tcp { .. } => IPPROTO_TCP,
                L4::Udp => IPPROTO_UDP,
            }
        }

        /// Serialises with a correct L4 checksum (IPv6 has no header checksum).
        pub fn build(&self) -> Vec<u8> {
            let (mut segment, csum_at) = segment(self.sport, self.dport, self.l4, &self.payload);
            let mut all = pseudo_header(self.src, self.dst, self.proto(), segment.len());
            all.extend_from_slice(&segment);
            let mut c = checksum(&all);
            if self.l4 == L4::Udp && c == 0 {
                c = 0xffff;
            }
            segment[csum_at..csum_at + 2].copy_from_slice(&c.to_be_bytes());
            let mut frame = Vec::with_capacity(ETH_HLEN + 40 + segment.len());
            frame.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x02]); // dst MAC
            frame.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x01]); // src MAC
            frame.extend_from_slice(&0x86ddu16.to_be_bytes());
            frame.extend_from_slice(&0x6000_0000u32.to_be_bytes());
            frame.extend_from_slice(&(segment.len() as u16).to_be_bytes());
            frame.push(self.proto());
            frame.push(64);
            frame.extend_from_slice(&self.src.octets());
            frame.extend_from_slice(&self.dst.octets());
            frame.extend_from_slice(&segment);
            frame
        }
    }

    /// A parsed view of an IPv6 frame.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct Parsed6 {
        pub src: Ipv6Addr,
        pub dst: Ipv6Addr,
        pub proto: u8,
        pub sport: u16,
        pub dport: u16,
        /// The bytes after the IPv6 header, up to its payload length.
        pub l4: Vec<u8>,
    }

    pub fn parse(frame: &[u8]) -> Parsed6 {
        assert!(frame.len() >= ETH_HLEN + 40, "frame too short");
        assert_eq!(&frame[12..14], &[0x86, 0xdd], "not IPv6");
        let ip = &frame[ETH_HLEN..];
        let len = u16::from_be_bytes([ip[4], ip[5]]) as usize;
        assert!(
            40 + len <= ip.len(),
            "payload length {len} beyond the frame"
        );
        let octets = |at: usize| -> [u8; 16] { ip[at..at + 16].try_into().unwrap() };
        let l4 = ip[40..40 + len].to_vec();
        Parsed6 {
            src: Ipv6Addr::from(octets(8)),
            dst: Ipv6Addr::from(octets(24)),
            proto: ip[6],
            sport: u16::from_be_bytes([l4[0], l4[1]]),
            dport: u16::from_be_bytes([l4[2], l4[3]]),
            l4,
        }
    }

    impl Parsed6 {
        /// The transport checksum verifies (over the IPv6 pseudo-header).
        pub fn l4_checksum_ok(&self) -> bool {
            let mut all = pseudo_header(self.src, self.dst, self.proto, self.l4.len());
            all.extend_from_slice(&self.l4);
            checksum(&all) == 0
        }
    }
}

/// Whether a frame of either family has a valid IPv4 header checksum (IPv6 has none) and
/// L4 checksum, computed here independently of the kernel.
pub fn checksums_ok(frame: &[u8]) -> bool {
    if frame[12..14] == [0x86, 0xdd] {
        ipv6::parse(frame).l4_checksum_ok()
    } else {
        let p = parse(frame);
        p.ip_checksum_ok() && p.l4_checksum_ok()
    }
}

/// Source and destination of a frame of either family.
pub fn ends(frame: &[u8]) -> (std::net::SocketAddr, std::net::SocketAddr) {
    use std::net::SocketAddr;
    if frame[12..14] == [0x86, 0xdd] {
        let p = ipv6::parse(frame);
        (
            SocketAddr::new(p.src.into(), p.sport),
            SocketAddr::new(p.dst.into(), p.dport),
        )
    } else {
        let p = parse(frame);
        (
            SocketAddr::new(p.src.into(), p.sport),
            SocketAddr::new(p.dst.into(), p.dport),
        )
    }
}

/// A parsed view of an IPv4 frame, for assertions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Parsed {
    pub src_mac: [u8; 6],
    pub dst_mac: [u8; 6],
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub proto: u8,
    pub ttl: u8,
    pub sport: u16,
    pub dport: u16,
    /// Bytes after the IPv4 header (up to total length).
    pub l4: Vec<u8>,
    /// The IPv4 header as on the wire.
    pub ip_header: Vec<u8>,
}

pub fn parse(frame: &[u8]) -> Parsed {
    assert!(
        frame.len() >= ETH_HLEN + 20,
        "frame too short: {} bytes",
        frame.len()
    );
    assert_eq!(&frame[12..14], &[0x08, 0x00], "not IPv4");
    let ip = &frame[ETH_HLEN..];
    let ihl = ((ip[0] & 0x0f) as usize) * 4;
    let total = u16::from_be_bytes([ip[2], ip[3]]) as usize;
    assert!(
        total <= ip.len(),
        "IPv4 total length {total} beyond the frame"
    );
    let l4 = ip[ihl..total].to_vec();
    let (sport, dport) = if l4.len() >= 4 {
        (
            u16::from_be_bytes([l4[0], l4[1]]),
            u16::from_be_bytes([l4[2], l4[3]]),
        )
    } else {
        (0, 0)
    };
    Parsed {
        dst_mac: frame[0..6].try_into().unwrap(),
        src_mac: frame[6..12].try_into().unwrap(),
        src: Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]),
        dst: Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]),
        proto: ip[9],
        ttl: ip[8],
        sport,
        dport,
        l4,
        ip_header: ip[..ihl].to_vec(),
    }
}

impl Parsed {
    /// The IPv4 header checksum verifies.
    pub fn ip_checksum_ok(&self) -> bool {
        fold(ones_complement_sum(&self.ip_header)) == 0xffff
    }

    /// The L4 checksum verifies (a UDP checksum of 0, "none", counts as valid).
    pub fn l4_checksum_ok(&self) -> bool {
        match self.proto {
            IPPROTO_UDP if self.l4[6..8] == [0, 0] => true,
            IPPROTO_TCP | IPPROTO_UDP => {
                let mut all = pseudo_header(self.src, self.dst, self.proto, self.l4.len());
                all.extend_from_slice(&self.l4);
                fold(ones_complement_sum(&all)) == 0xffff
            }
            IPPROTO_ICMP => fold(ones_complement_sum(&self.l4)) == 0xffff,
            other => panic!("no checksum rule for protocol {other}"),
        }
    }

    pub fn udp_checksum_field(&self) -> u16 {
        u16::from_be_bytes([self.l4[6], self.l4[7]])
    }
}

/// Raw IPv4 sockets, for segments no socket of the kernel would send (call them inside a
/// namespace).
pub mod raw {
    use std::{
        net::Ipv4Addr,
        os::fd::{AsRawFd, FromRawFd, OwnedFd},
        time::{Duration, Instant},
    };

    fn socket(proto: libc::c_int) -> std::io::Result<OwnedFd> {
        // SAFETY: a plain socket call; the descriptor is owned at once.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, proto) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a descriptor we just opened.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Sends `frame`'s IPv4 packet (after its Ethernet header) as it is, header included.
    pub fn send_ipv4(frame: &[u8]) -> std::io::Result<()> {
        let packet = &frame[super::ETH_HLEN..];
        let to = super::parse(frame).dst;
        let fd = socket(libc::IPPROTO_RAW)?;
        let addr = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 0,
            sin_addr: libc::in_addr {
                s_addr: u32::from(to).to_be(),
            },
            sin_zero: [0; 8],
        };
        // SAFETY: valid buffer and address of the sizes given.
        let n = unsafe {
            libc::sendto(
                fd.as_raw_fd(),
                packet.as_ptr().cast(),
                packet.len(),
                0,
                (&addr as *const libc::sockaddr_in).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// A copy of every TCP segment this namespace receives, from the moment it is opened.
    pub struct TcpTap(OwnedFd);

    impl TcpTap {
        pub fn open() -> std::io::Result<Self> {
            let fd = socket(libc::IPPROTO_TCP)?;
            let tv = libc::timeval {
                tv_sec: 0,
                tv_usec: 100_000,
            };
            // SAFETY: a valid timeval for SO_RCVTIMEO.
            unsafe {
                libc::setsockopt(
                    fd.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_RCVTIMEO,
                    (&tv as *const libc::timeval).cast(),
                    std::mem::size_of::<libc::timeval>() as libc::socklen_t,
                )
            };
            Ok(TcpTap(fd))
        }

        /// The next segment received within `within`.
        pub fn next(&self, within: Duration) -> Option<Segment> {
            let deadline = Instant::now() + within;
            let mut buf = [0u8; 65536];
            while Instant::now() < deadline {
                // SAFETY: a buffer of the size given.
                let n = unsafe {
                    libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0)
                };
                let Ok(n) = usize::try_from(n) else {
                    continue;
                };
                let ihl = usize::from(buf[0] & 0xf) * 4;
                if n < ihl + 20 {
                    continue;
                }
                let total = usize::from(u16::from_be_bytes([buf[2], buf[3]])).min(n);
                let tcp = &buf[ihl..];
                let data_off = usize::from(tcp[12] >> 4) * 4;
                return Some(Segment {
                    src: Ipv4Addr::new(buf[12], buf[13], buf[14], buf[15]),
                    sport: u16::from_be_bytes([tcp[0], tcp[1]]),
                    seq: u32::from_be_bytes([tcp[4], tcp[5], tcp[6], tcp[7]]),
                    len: total.saturating_sub(ihl + data_off) as u32,
                });
            }
            None
        }

        /// The first segment from `from`:`port` within `within` for which `pick` holds.
        pub fn find(
            &self,
            from: Ipv4Addr,
            port: u16,
            within: Duration,
            pick: impl Fn(&Segment) -> bool,
        ) -> Option<Segment> {
            let deadline = Instant::now() + within;
            while let Some(s) = self.next(deadline.saturating_duration_since(Instant::now())) {
                if s.src == from && s.sport == port && pick(&s) {
                    return Some(s);
                }
            }
            None
        }
    }

    /// What [`TcpTap`] reports of a segment.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Segment {
        pub src: Ipv4Addr,
        pub sport: u16,
        pub seq: u32,
        /// Payload bytes.
        pub len: u32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The checker must catch what it is there to catch, or the datapath tests prove nothing.
    #[test]
    fn ipv6_checker_rejects_a_corrupted_segment_and_address() {
        let a = "fd00::1".parse().unwrap();
        let b = "fd00::2".parse().unwrap();
        for spec in [
            ipv6::PacketSpec6::tcp(a, 1000, b, 80, TCP_SYN),
            ipv6::PacketSpec6::udp(a, 1000, b, 53, b"payload"),
        ] {
            let frame = spec.build();
            assert!(ipv6::parse(&frame).l4_checksum_ok());
            let mut bad = frame.clone();
            bad[ETH_HLEN + 40 + 2] ^= 0x01; // destination port
            assert!(!ipv6::parse(&bad).l4_checksum_ok());
            let mut bad = frame.clone();
            bad[ETH_HLEN + 24 + 15] ^= 0x01; // destination address: pseudo-header
            assert!(!ipv6::parse(&bad).l4_checksum_ok());
        }
    }

    #[test]
    fn checker_rejects_a_corrupted_segment_and_header() {
        let a = Ipv4Addr::new(10, 0, 0, 1);
        let b = Ipv4Addr::new(10, 0, 0, 2);
        for spec in [
            PacketSpec::tcp(a, 1000, b, 80, TCP_SYN),
            PacketSpec::udp(a, 1000, b, 53, b"payload"),
        ] {
            let frame = spec.build();
            let p = parse(&frame);
            assert!(p.ip_checksum_ok() && p.l4_checksum_ok());
            let mut bad = frame.clone();
            bad[ETH_HLEN + 20 + 2] ^= 0x01; // destination port
            assert!(!parse(&bad).l4_checksum_ok());
            let mut bad = frame.clone();
            bad[ETH_HLEN + 16] ^= 0x01; // destination address: IP header and pseudo-header
            assert!(!parse(&bad).ip_checksum_ok());
            assert!(!parse(&bad).l4_checksum_ok());
        }
    }

    #[test]
    fn checksum_matches_rfc1071_example() {
        // RFC 1071 section 3 example: words 0001 f203 f4f5 f6f7 sum to 2ddf0, which folds
        // to ddf2; the checksum is its complement.
        let data = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7];
        assert_eq!(ones_complement_sum(&data), 0x2ddf0);
        assert_eq!(fold(ones_complement_sum(&data)), 0xddf2);
        assert_eq!(checksum(&data), 0x220d);
    }

    #[test]
    fn partial_seed_completes_to_the_full_checksum() {
        let a = Ipv4Addr::new(192, 0, 2, 1);
        let b = Ipv4Addr::new(192, 0, 2, 2);
        let mut seg = vec![0u8; 20];
        seg[12] = 0x50;
        let seed = partial_seed(a, b, IPPROTO_TCP, seg.len());
        seg[16..18].copy_from_slice(&seed.to_be_bytes());
        // What offload hardware does: checksum the segment with the seed in place.
        let full = checksum(&seg);
        seg[16..18].copy_from_slice(&full.to_be_bytes());
        assert_eq!(full, {
            let mut s = seg.clone();
            s[16..18].copy_from_slice(&[0, 0]);
            l4_checksum(a, b, IPPROTO_TCP, &s)
        });
    }
}
