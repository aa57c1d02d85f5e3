//! The eBPF programs against frames no test wrote by hand: well-formed frames to every kind
//! of frontend, then mutated (bytes flipped, truncated, extended, checksums spoiled), IPv4
//! options, IPv6 extension headers, fragments, ICMP errors quoting a translated flow, and
//! frames of no service, through `BPF_PROG_TEST_RUN` at both hooks of a populated datapath
//! (ClusterIPs of both families, a NodePort that source-NATs to a remote backend, a
//! load-balancer IP with source ranges, ClientIP affinity, a Service without endpoints).
//!
//! What must hold for every frame:
//! * the run succeeds and the verdict is one the programs give (next, ok, drop, redirect);
//! * a frame whose addresses are none the datapath knows leaves byte-identical, "next";
//! * a frame the programs changed has valid IP and L4 checksums, computed here
//!   independently, when the frame came in with valid ones;
//! * the maps never hold more entries than they were made for.
//!
//! The frames come from a seeded generator: `PROXY_PACKET_FUZZ_SEED` replays a failure
//! (the failing frame and seed are in the message), `PROXY_PACKET_FUZZ_FRAMES` runs more.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4};

use proxy_agent::{
    datapath::DatapathSizes,
    model::{Frontend, Protocol},
    proxier::ebpf::sync::{FrontendSpec, HeaderSettings},
};
use proxy_tests::{
    kernel::{Hook, TestDatapath, TC_ACT_REDIRECT, TC_ACT_SHOT, TC_ACT_UNSPEC},
    packet::{fold, ones_complement_sum, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
    require_kernel,
};

const TC_ACT_OK: i32 = 0;
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const STICKY_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);
const EMPTY_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 12);
const LB_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 50);
const NODE: Ipv4Addr = Ipv4Addr::new(10, 250, 1, 1);
const NODE_INTERNAL: Ipv4Addr = Ipv4Addr::new(10, 251, 0, 1);
const VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x10);

fn backends4() -> Vec<SocketAddrV4> {
    (1..=3)
        .map(|i| SocketAddrV4::new(Ipv4Addr::new(10, 244, i, 11), 8080))
        .collect()
}

fn remote4() -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::new(10, 244, 9, 11), 8080)
}

fn backends6() -> Vec<SocketAddr> {
    (1..=3u16)
        .map(|i| {
            SocketAddr::new(
                Ipv6Addr::new(0xfd00, 0x10, 0x244, i, 0, 0, 0, 0x11).into(),
                8080,
            )
        })
        .collect()
}

/// Every address the datapath has state for: a frame with none of them as source or
/// destination is not the datapath's business.
fn known(addr: IpAddr) -> bool {
    let mut all: Vec<IpAddr> = vec![
        VIP.into(),
        STICKY_VIP.into(),
        EMPTY_VIP.into(),
        LB_IP.into(),
        NODE.into(),
        NODE_INTERNAL.into(),
        VIP6.into(),
        remote4().ip().to_owned().into(),
        Ipv4Addr::from(proxy_common::HAIRPIN_SOURCE).into(),
        Ipv6Addr::from(proxy_common::HAIRPIN_SOURCE6).into(),
    ];
    all.extend(backends4().iter().map(|b| IpAddr::V4(*b.ip())));
    all.extend(backends6().iter().map(|b| b.ip()));
    all.contains(&addr)
}

fn populated() -> TestDatapath {
    let mut dp = TestDatapath::load(DatapathSizes {
        services: 1024,
        backends: 1024,
        conntrack: 4096,
        maglev: 65536,
    })
    .expect("load datapath");
    dp.datapath
        .configure(&proxy_common::DatapathConfig {
            masquerade_addr: u32::from(NODE_INTERNAL).to_be(),
            ..proxy_common::DatapathConfig::DEFAULT
        })
        .unwrap();
    for protocol in [Protocol::Tcp, Protocol::Udp] {
        let at = |addr: IpAddr, port| Frontend {
            addr,
            port,
            protocol,
        };
        dp.set_service(at(VIP.into(), 80), &backends4()).unwrap();
        dp.set_service(at(EMPTY_VIP.into(), 80), &[]).unwrap();
        dp.set_service_with(
            at(STICKY_VIP.into(), 80),
            &backends4(),
            HeaderSettings {
                flags: 0,
                affinity_timeout: 600,
            },
            &[],
        )
        .unwrap();
        let external = HeaderSettings {
            flags: proxy_common::SERVICE_FLAG_EXTERNAL | proxy_common::SERVICE_FLAG_MASQUERADE,
            affinity_timeout: 0,
        };
        dp.set_service_with(at(NODE.into(), 30080), &[remote4()], external, &[remote4()])
            .unwrap();
        let backends: Vec<SocketAddr> = backends4().into_iter().map(SocketAddr::V4).collect();
        let ranges = [(IpAddr::from(Ipv4Addr::new(198, 51, 100, 0)), 24)];
        dp.sync
            .set_with(
                at(LB_IP.into(), 80),
                &FrontendSpec {
                    header: external,
                    source_ranges: &ranges,
                    ..FrontendSpec::new(&backends)
                },
            )
            .unwrap();
        dp.sync.set(at(VIP6.into(), 80), &backends6()).unwrap();
    }
    dp
}

/// xorshift64*: small, seeded, reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn byte(&mut self) -> u8 {
        self.next() as u8
    }
    fn chance(&mut self, one_in: u64) -> bool {
        self.below(one_in) == 0
    }
    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[self.below(from.len() as u64) as usize]
    }
}

// --- Frames, built here (not with the test crate's builders) so they can be malformed ---

fn ethernet(ethertype: u16) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2];
    f.extend_from_slice(&ethertype.to_be_bytes());
    f
}

fn l4_segment(rng: &mut Rng, proto: u8, sport: u16, dport: u16) -> Vec<u8> {
    let payload_len = rng.below(40) as usize;
    let mut s = Vec::new();
    s.extend_from_slice(&sport.to_be_bytes());
    s.extend_from_slice(&dport.to_be_bytes());
    match proto {
        6 => {
            s.extend_from_slice(&(rng.next() as u32).to_be_bytes());
            s.extend_from_slice(&(rng.next() as u32).to_be_bytes());
            s.push(5 << 4);
            let any = rng.byte();
            s.push(rng.pick(&[
                TCP_SYN,
                TCP_ACK,
                TCP_SYN | TCP_ACK,
                TCP_FIN | TCP_ACK,
                TCP_RST,
                any,
            ]));
            s.extend_from_slice(&[0xfa, 0xf0, 0, 0, 0, 0]);
        }
        _ => {
            s.extend_from_slice(&((8 + payload_len) as u16).to_be_bytes());
            s.extend_from_slice(&[0, 0]);
        }
    }
    s.extend((0..payload_len).map(|_| rng.byte()));
    s
}

fn sum16(data: &[u8]) -> u16 {
    !fold(ones_complement_sum(data))
}

fn pseudo4(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, len: usize) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    p.extend_from_slice(&[0, proto]);
    p.extend_from_slice(&(len as u16).to_be_bytes());
    p
}

fn pseudo6(src: Ipv6Addr, dst: Ipv6Addr, proto: u8, len: usize) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    p.extend_from_slice(&(len as u32).to_be_bytes());
    p.extend_from_slice(&[0, 0, 0, proto]);
    p
}

/// Fills in a TCP/UDP/ICMP checksum field of `seg` given its pseudo-header (none: ICMP).
fn seal(seg: &mut [u8], proto: u8, pseudo: Option<Vec<u8>>) {
    let at = match proto {
        6 => 16,
        17 => 6,
        1 | 58 => 2,
        _ => return,
    };
    if seg.len() < at + 2 {
        return;
    }
    seg[at..at + 2].copy_from_slice(&[0, 0]);
    let mut all = pseudo.unwrap_or_default();
    all.extend_from_slice(seg);
    let mut c = sum16(&all);
    if proto == 17 && c == 0 {
        c = 0xffff;
    }
    seg[at..at + 2].copy_from_slice(&c.to_be_bytes());
}

/// An IPv4 frame; `options` words of IP options; `fragment`: (more fragments, offset).
fn ipv4(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    proto: u8,
    mut l4: Vec<u8>,
    options: usize,
    fragment: (bool, u16),
) -> Vec<u8> {
    if fragment == (false, 0) {
        let pseudo = (proto != 1).then(|| pseudo4(src, dst, proto, l4.len()));
        seal(&mut l4, proto, pseudo);
    }
    let ihl = 5 + options;
    let total = ihl * 4 + l4.len();
    let mut ip = vec![(4 << 4) | ihl as u8, 0];
    ip.extend_from_slice(&(total as u16).to_be_bytes());
    ip.extend_from_slice(&0x1234u16.to_be_bytes());
    let frag = (u16::from(fragment.0) << 13) | fragment.1;
    ip.extend_from_slice(&frag.to_be_bytes());
    ip.extend_from_slice(&[64, proto, 0, 0]);
    ip.extend_from_slice(&src.octets());
    ip.extend_from_slice(&dst.octets());
    // NOPs, then an end-of-options.
    ip.extend(std::iter::repeat_n(1u8, options * 4));
    if options > 0 {
        *ip.last_mut().unwrap() = 0;
    }
    let c = sum16(&ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    let mut f = ethernet(0x0800);
    f.extend_from_slice(&ip);
    f.extend_from_slice(&l4);
    f
}

/// An IPv6 frame with `extensions` (each a next-header value: 0 hop-by-hop, 43 routing,
/// 60 destination options, 44 fragment) before the transport header.
fn ipv6(src: Ipv6Addr, dst: Ipv6Addr, proto: u8, mut l4: Vec<u8>, extensions: &[u8]) -> Vec<u8> {
    let fragmented = extensions.contains(&44);
    if !fragmented {
        let pseudo = pseudo6(src, dst, proto, l4.len());
        seal(&mut l4, proto, Some(pseudo));
    }
    let mut chain = Vec::new();
    for (i, kind) in extensions.iter().enumerate() {
        let next = extensions.get(i + 1).copied().unwrap_or(proto);
        match kind {
            44 => chain.extend_from_slice(&[next, 0, 0, 0, 0, 0, 0x12, 0x34]),
            _ => chain.extend_from_slice(&[next, 0, 1, 4, 0, 0, 0, 0]),
        }
    }
    let first = extensions.first().copied().unwrap_or(proto);
    let mut f = ethernet(0x86dd);
    f.extend_from_slice(&[0x60, 0, 0, 0]);
    f.extend_from_slice(&((chain.len() + l4.len()) as u16).to_be_bytes());
    f.extend_from_slice(&[first, 64]);
    f.extend_from_slice(&src.octets());
    f.extend_from_slice(&dst.octets());
    f.extend_from_slice(&chain);
    f.extend_from_slice(&l4);
    f
}

fn client4(rng: &mut Rng) -> Ipv4Addr {
    match rng.below(3) {
        0 => Ipv4Addr::new(10, 244, 0, rng.byte()),
        1 => Ipv4Addr::new(198, 51, 100, rng.byte()),
        _ => Ipv4Addr::new(203, 0, 113, rng.byte()),
    }
}

fn client6(rng: &mut Rng) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, rng.below(256) as u16)
}

/// A well-formed frame of one of the kinds the datapath meets.
fn template(rng: &mut Rng) -> Vec<u8> {
    let proto = rng.pick(&[6u8, 17]);
    let sport = 1024 + rng.below(64) as u16;
    match rng.below(10) {
        // To a frontend.
        0..=2 => {
            let (dst, port) = rng.pick(&[
                (VIP, 80),
                (STICKY_VIP, 80),
                (EMPTY_VIP, 80),
                (LB_IP, 80),
                (NODE, 30080),
            ]);
            let l4 = l4_segment(rng, proto, sport, port);
            ipv4(client4(rng), dst, proto, l4, 0, (false, 0))
        }
        // A backend's reply, or a masqueraded backend's.
        3 => {
            let b = rng.pick(&[backends4()[0], backends4()[1], remote4()]);
            let to = if rng.chance(2) {
                NODE_INTERNAL
            } else {
                client4(rng)
            };
            let l4 = l4_segment(rng, proto, b.port(), sport);
            ipv4(*b.ip(), to, proto, l4, 0, (false, 0))
        }
        // IPv6, maybe with extension headers.
        4 | 5 => {
            let extensions: Vec<u8> = (0..rng.below(3))
                .map(|_| rng.pick(&[0u8, 43, 60, 44]))
                .collect();
            let (src, dst, sp, dp) = if rng.chance(3) {
                let b = backends6()[0];
                (b.ip(), IpAddr::V6(client6(rng)), b.port(), sport)
            } else {
                (IpAddr::V6(client6(rng)), IpAddr::V6(VIP6), sport, 80)
            };
            let (IpAddr::V6(src), IpAddr::V6(dst)) = (src, dst) else {
                unreachable!()
            };
            ipv6(src, dst, proto, l4_segment(rng, proto, sp, dp), &extensions)
        }
        // IPv4 options or a fragment, to a frontend.
        6 => {
            let l4 = l4_segment(rng, proto, sport, 80);
            let fragment = match rng.below(3) {
                0 => (true, 0),
                1 => (rng.chance(2), 1 + rng.below(100) as u16),
                _ => (false, 0),
            };
            ipv4(
                client4(rng),
                VIP,
                proto,
                l4,
                rng.below(11) as usize,
                fragment,
            )
        }
        // An ICMP error quoting a flow to a frontend (as a router on the way sends it).
        7 => {
            let quoted = ipv4(
                VIP,
                client4(rng),
                proto,
                l4_segment(rng, proto, 80, sport),
                0,
                (false, 0),
            );
            let mut icmp = vec![3, rng.pick(&[1u8, 3, 4]), 0, 0, 0, 0, 0x05, 0xdc];
            icmp.extend_from_slice(&quoted[14..(14 + 28).min(quoted.len())]);
            ipv4(Ipv4Addr::new(10, 1, 1, 1), VIP, 1, icmp, 0, (false, 0))
        }
        // Nobody's business: neither end is known to the datapath.
        _ => {
            if rng.chance(2) {
                let l4 = l4_segment(rng, proto, sport, 80);
                ipv4(
                    client4(rng),
                    Ipv4Addr::new(172, 16, 0, rng.byte()),
                    proto,
                    l4,
                    0,
                    (false, 0),
                )
            } else {
                let dst = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, rng.below(256) as u16);
                ipv6(
                    client6(rng),
                    dst,
                    proto,
                    l4_segment(rng, proto, sport, 80),
                    &[],
                )
            }
        }
    }
}

/// Spoils `frame` in one to four ways.
fn mutate(rng: &mut Rng, frame: &mut Vec<u8>) {
    for _ in 0..1 + rng.below(4) {
        match rng.below(6) {
            0 | 1 => {
                let at = rng.below(frame.len() as u64) as usize;
                frame[at] ^= 1 << rng.below(8);
            }
            2 => {
                let at = rng.below(frame.len() as u64) as usize;
                frame[at] = rng.byte();
            }
            3 => frame.truncate(14 + rng.below(frame.len().saturating_sub(13) as u64) as usize),
            4 => frame.extend((0..rng.below(64)).map(|_| rng.byte())),
            _ => {
                // A header length or total length that lies.
                if frame.len() > 18 {
                    let at = rng.pick(&[14usize, 16, 17, 18]);
                    frame[at] = rng.byte();
                }
            }
        }
    }
}

/// The addresses of an IPv4 or IPv6 frame, if it has a whole IP header.
fn addresses(frame: &[u8]) -> Option<(IpAddr, IpAddr)> {
    match u16::from_be_bytes([*frame.get(12)?, *frame.get(13)?]) {
        0x0800 if frame.len() >= 34 => {
            let a = |at: usize| IpAddr::from(<[u8; 4]>::try_from(&frame[at..at + 4]).unwrap());
            Some((a(26), a(30)))
        }
        0x86dd if frame.len() >= 54 => {
            let a = |at: usize| IpAddr::from(<[u8; 16]>::try_from(&frame[at..at + 16]).unwrap());
            Some((a(22), a(38)))
        }
        _ => None,
    }
}

/// Whether a frame's IP and L4 checksums verify; `None` where they cannot be checked here
/// (not IP, truncated or lying lengths, fragments, extension headers, other protocols).
fn checksums_ok(frame: &[u8]) -> Option<bool> {
    let ethertype = u16::from_be_bytes([*frame.get(12)?, *frame.get(13)?]);
    let ip = frame.get(14..)?;
    match ethertype {
        0x0800 => {
            let ihl = usize::from(*ip.first()? & 0x0f) * 4;
            let total = usize::from(u16::from_be_bytes([*ip.get(2)?, *ip.get(3)?]));
            if ip[0] >> 4 != 4 || ihl < 20 || total < ihl || total > ip.len() {
                return None;
            }
            let header_ok = sum16(&ip[..ihl]) == 0;
            let fragment = u16::from_be_bytes([ip[6], ip[7]]) & 0x3fff != 0;
            let proto = ip[9];
            let l4 = &ip[ihl..total];
            if fragment || !matches!(proto, 1 | 6 | 17) {
                return Some(header_ok);
            }
            if proto == 17 && l4.len() >= 8 && l4[6..8] == [0, 0] {
                return Some(header_ok);
            }
            let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
            let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
            let mut all = if proto == 1 {
                Vec::new()
            } else {
                pseudo4(src, dst, proto, l4.len())
            };
            all.extend_from_slice(l4);
            Some(header_ok && sum16(&all) == 0)
        }
        0x86dd => {
            if ip.len() < 40 || ip[0] >> 4 != 6 {
                return None;
            }
            let payload = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
            let proto = ip[6];
            if 40 + payload > ip.len() || !matches!(proto, 6 | 17 | 58) {
                return None;
            }
            let src = Ipv6Addr::from(<[u8; 16]>::try_from(&ip[8..24]).unwrap());
            let dst = Ipv6Addr::from(<[u8; 16]>::try_from(&ip[24..40]).unwrap());
            let l4 = &ip[40..40 + payload];
            let mut all = pseudo6(src, dst, proto, l4.len());
            all.extend_from_slice(l4);
            Some(sum16(&all) == 0)
        }
        _ => None,
    }
}

fn shorter_than_its_ip_header(frame: &[u8]) -> bool {
    match frame.get(12..14) {
        Some([0x08, 0x00]) => frame.len() < 14 + 20,
        Some([0x86, 0xdd]) => frame.len() < 14 + 40,
        _ => false,
    }
}

fn hex(frame: &[u8]) -> String {
    frame.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn random_and_mutated_frames_keep_the_datapaths_invariants() {
    require_kernel!();
    let seed: u64 = std::env::var("PROXY_PACKET_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_2026_1202);
    let frames: u64 = std::env::var("PROXY_PACKET_FUZZ_FRAMES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60_000);
    let mut dp = populated();
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).max(1));
    let (mut translated, mut untouched, mut checked, mut refused) = (0u64, 0u64, 0u64, 0u64);
    for i in 0..frames {
        let mut frame = template(&mut rng);
        if rng.chance(2) {
            mutate(&mut rng, &mut frame);
        }
        let hook = if rng.chance(3) {
            Hook::Egress
        } else {
            Hook::Ingress
        };
        let context = || format!("frame {i} (seed {seed}) at {hook:?}: {}", hex(&frame));
        let (verdict, out) = match dp.run(hook, &frame) {
            Ok(done) => done,
            // BPF_PROG_TEST_RUN itself refuses a frame shorter than the IP header its
            // ethertype announces (the program never sees it); nothing else may fail.
            Err(_) if shorter_than_its_ip_header(&frame) => {
                refused += 1;
                continue;
            }
            Err(e) => panic!("the program run failed ({e:#}) on {}", context()),
        };
        assert!(
            [TC_ACT_UNSPEC, TC_ACT_OK, TC_ACT_SHOT, TC_ACT_REDIRECT].contains(&verdict),
            "verdict {verdict} on {}",
            context()
        );
        let foreign = match addresses(&frame) {
            Some((src, dst)) => !known(src) && !known(dst),
            None => true,
        };
        if foreign {
            assert_eq!(
                (verdict, hex(&out)),
                (TC_ACT_UNSPEC, hex(&frame)),
                "a frame of no service was changed: {}",
                context()
            );
            untouched += 1;
        }
        if out != frame && verdict != TC_ACT_SHOT {
            translated += 1;
            if checksums_ok(&frame) == Some(true) {
                assert_eq!(
                    checksums_ok(&out),
                    Some(true),
                    "translated with a bad checksum: {} -> {}",
                    context(),
                    hex(&out)
                );
                checked += 1;
            }
        }
    }
    let sweep = dp.datapath.collect_conntrack_garbage().unwrap();
    assert!(
        sweep.remaining <= 4096 && sweep.remaining6 <= 4096,
        "{sweep:?}"
    );
    let new_room = proxy_agent::datapath::new_flows_size(4096) as usize;
    assert!(
        sweep.remaining_new <= new_room && sweep.remaining_new6 <= new_room,
        "{sweep:?}"
    );
    eprintln!(
        "{frames} frames (seed {seed}): {translated} changed ({checked} with checksums verified), {untouched} of no service left alone, {refused} too short for BPF_PROG_TEST_RUN"
    );
    // The generator must reach what it is for, or the invariants were never exercised.
    assert!(translated > frames / 10, "{translated} of {frames} changed");
    assert!(checked > frames / 20, "{checked} checked");
    assert!(untouched > frames / 20, "{untouched} foreign");
}

/// The checker must catch what it is there to catch, or the invariant above proves nothing.
#[test]
fn the_checksum_checker_catches_a_spoiled_frame() {
    let mut rng = Rng(7);
    for _ in 0..200 {
        let frame = template(&mut rng);
        let Some(ok) = checksums_ok(&frame) else {
            continue;
        };
        assert!(ok, "a generated frame has a bad checksum: {}", hex(&frame));
        // A bit flipped in an address (covered by both sums) must be seen.
        let mut spoiled = frame.clone();
        let at = if frame[12..14] == [0x08, 0x00] {
            29
        } else {
            37
        };
        spoiled[at] ^= 0x10;
        assert_eq!(checksums_ok(&spoiled), Some(false), "{}", hex(&spoiled));
    }
}
