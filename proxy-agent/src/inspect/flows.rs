//! `inspect flows --follow`: new flows as the eBPF datapath decides them, read from the
//! pinned `FLOW_EVENTS` ring buffer (see proxy-ebpf's `flows` module).
//!
//! The datapath records nothing until a listener writes its deadline into `FLOW_LISTENER`;
//! this command renews it every [`HEARTBEAT`] while it runs and clears it when it stops, so
//! a node nobody inspects pays one array lookup per new flow and nothing per packet. The
//! ring has one reader: a second follower is refused while the first one's deadline holds.
//! Each CPU sends at most `--rate` flows per second; what is held back (or lost to a full
//! ring) is counted in `FLOW_RATE` and reported on stderr.

use std::{
    collections::HashMap,
    io::Write,
    net::Ipv6Addr,
    path::Path,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{bail, Context, Result};
use aya::maps::{Array, HashMap as BpfHashMap, Map, MapData, PerCpuArray, RingBuf};
use proxy_common::{
    map_names, FlowEvent, FlowListener, FlowRate, ServiceName, FLOW_PATH_SOCKET_NODE,
    FLOW_PATH_SOCKET_POD, FLOW_PATH_TC, FLOW_VERDICT_DENIED, FLOW_VERDICT_DROPPED,
    FLOW_VERDICT_FORWARDED, FLOW_VERDICT_REFUSED,
};
use serde::Serialize;
use tokio::{io::unix::AsyncFd, signal::unix::SignalKind};

use super::Output;
use crate::{datapath::monotonic_ns, model::ObjectName};

/// How often the listener renews its deadline.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// How far ahead the deadline is set: the datapath stops sending this long after a
/// follower dies without clearing it.
const DEADLINE: Duration = Duration::from_secs(5);
/// `--rate`'s default and highest values (flows per second per CPU).
pub const DEFAULT_RATE: u32 = 1000;
pub const MAX_RATE: u32 = 100_000;

/// One new flow, as printed (`-o json`: one object per line, these field names).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FlowView {
    /// When the datapath decided it, milliseconds since the Unix epoch.
    pub time_unix_ms: u64,
    /// Where it was decided: `tc` (a packet), `socket-node` / `socket-pod` (a connect or
    /// sendmsg of the node's own process / a pod's, at the socket hooks).
    pub path: &'static str,
    /// `forwarded`, `refused` (no endpoint: the client got a reset or ECONNREFUSED),
    /// `dropped` (externalTrafficPolicy Local without a local endpoint), `denied` (outside
    /// loadBalancerSourceRanges).
    pub verdict: &'static str,
    pub protocol: &'static str,
    /// ADDRESS:PORT; absent on the socket path, which decides before the source is chosen.
    pub client: Option<String>,
    pub frontend: String,
    /// `namespace/name:port` of the frontend, as `SERVICE_NAMES` names it.
    pub service: Option<String>,
    /// ADDRESS:PORT of the chosen backend.
    pub backend: Option<String>,
}

fn path_name(path: u8) -> &'static str {
    match path {
        FLOW_PATH_TC => "tc",
        FLOW_PATH_SOCKET_NODE => "socket-node",
        FLOW_PATH_SOCKET_POD => "socket-pod",
        _ => "unknown",
    }
}

fn verdict_name(verdict: u8) -> &'static str {
    match verdict {
        FLOW_VERDICT_FORWARDED => "forwarded",
        FLOW_VERDICT_REFUSED => "refused",
        FLOW_VERDICT_DROPPED => "dropped",
        FLOW_VERDICT_DENIED => "denied",
        _ => "unknown",
    }
}

fn protocol_name(proto: u8) -> &'static str {
    match proto {
        proxy_common::IPPROTO_TCP => "TCP",
        proxy_common::IPPROTO_UDP => "UDP",
        proxy_common::IPPROTO_SCTP => "SCTP",
        _ => "other",
    }
}

/// `addr:port` (`[addr]:port` for IPv6), the address shown as IPv4 when IPv4-mapped.
fn endpoint(addr: [u8; 16], port: u16) -> String {
    let ip = Ipv6Addr::from(addr).to_canonical();
    std::net::SocketAddr::new(ip, u16::from_be(port)).to_string()
}

impl FlowView {
    /// `event` as shown; `boot_unix_ns` is the Unix time of monotonic 0.
    pub fn new(event: &FlowEvent, boot_unix_ns: u64, service: Option<String>) -> Self {
        // `::ffff:0.0.0.0` (an IPv4 socket's) and `::` (an IPv6 one's) alike.
        let unspecified = |a: &[u8; 16]| Ipv6Addr::from(*a).to_canonical().is_unspecified();
        Self {
            time_unix_ms: (boot_unix_ns + event.time_ns) / 1_000_000,
            path: path_name(event.path),
            verdict: verdict_name(event.verdict),
            protocol: protocol_name(event.proto),
            client: (!unspecified(&event.client))
                .then(|| endpoint(event.client, event.client_port)),
            frontend: endpoint(event.frontend, event.frontend_port),
            service,
            backend: (event.backend_id != 0).then(|| endpoint(event.backend, event.backend_port)),
        }
    }

    /// The table's header line, for [`FlowView::row`]'s columns.
    pub fn header() -> String {
        row([
            "TIME (UTC)",
            "PATH",
            "PROTO",
            "CLIENT",
            "FRONTEND",
            "SERVICE",
            "BACKEND",
            "VERDICT",
        ])
    }

    /// One table line (streamed, so in fixed-width columns; a longer value widens its row).
    pub fn row(&self) -> String {
        row([
            &clock(self.time_unix_ms),
            self.path,
            self.protocol,
            self.client.as_deref().unwrap_or("-"),
            &self.frontend,
            self.service.as_deref().unwrap_or("-"),
            self.backend.as_deref().unwrap_or("-"),
            self.verdict,
        ])
    }
}

fn row(cells: [&str; 8]) -> String {
    const WIDTHS: [usize; 7] = [12, 11, 5, 21, 21, 24, 21];
    let mut line = String::new();
    for (cell, width) in cells.iter().zip(WIDTHS) {
        line.push_str(&format!("{cell:<width$}  "));
    }
    line.push_str(cells[7]);
    line + "\n"
}

/// `HH:MM:SS.mmm` (UTC) of a Unix time in milliseconds.
fn clock(unix_ms: u64) -> String {
    let day_ms = unix_ms % 86_400_000;
    format!(
        "{:02}:{:02}:{:02}.{:03}",
        day_ms / 3_600_000,
        day_ms / 60_000 % 60,
        day_ms / 1000 % 60,
        day_ms % 1000
    )
}

/// What `inspect flows --follow` was asked for.
pub struct Follow<'a> {
    pub root: &'a Path,
    pub service: Option<&'a ObjectName>,
    pub count: Option<u64>,
    pub rate: u32,
    pub output: Output,
}

/// The pinned maps a follower uses besides the ring.
struct Pins {
    listener: Array<MapData, FlowListener>,
    rate: PerCpuArray<MapData, FlowRate>,
    names: Option<BpfHashMap<MapData, u32, ServiceName>>,
}

impl Pins {
    /// The maps, and the ring.
    fn open(root: &Path) -> Result<(Self, RingBuf<MapData>)> {
        let dir = root.join("maps");
        let open = |name: &str| {
            let pin = dir.join(name);
            MapData::from_pin(&pin).with_context(|| {
                format!(
                    "opening {}: is the agent running in eBPF mode with --bpffs-root {} (in the netfilter and ipvs modes, `conntrack -E` follows new flows)?",
                    pin.display(),
                    root.display()
                )
            })
        };
        let ring = RingBuf::try_from(Map::RingBuf(open(map_names::FLOW_EVENTS)?))?;
        let pins = Self {
            listener: Array::try_from(Map::Array(open(map_names::FLOW_LISTENER)?))?,
            rate: PerCpuArray::try_from(Map::PerCpuArray(open(map_names::FLOW_RATE)?))?,
            names: open(map_names::SERVICE_NAMES)
                .ok()
                .and_then(|m| BpfHashMap::try_from(Map::HashMap(m)).ok()),
        };
        Ok((pins, ring))
    }

    /// Sets (or renews) this process's deadline; refuses while another follower's holds.
    fn listen(&mut self, rate: u32) -> Result<()> {
        let me = std::process::id();
        let now = monotonic_ns();
        let current = self.listener.get(&0, 0)?;
        if current.until_ns > now && current.owner != me && current.owner != 0 {
            bail!(
                "another `inspect flows --follow` (pid {}) is following this node's flows: the ring has one reader",
                current.owner
            );
        }
        let value = FlowListener {
            until_ns: now + DEADLINE.as_nanos() as u64,
            owner: me,
            max_per_second: rate,
        };
        self.listener.set(0, value, 0)?;
        Ok(())
    }

    /// Clears the deadline if it is still this process's: the datapath stops at once.
    fn stop(&mut self) {
        if matches!(self.listener.get(&0, 0), Ok(l) if l.owner == std::process::id()) {
            let _ = self.listener.set(0, FlowListener::default(), 0);
        }
    }

    /// Flows held back by the rate limit and lost to a full ring, over every CPU.
    fn not_sent(&self) -> (u64, u64) {
        self.rate.get(&0, 0).map_or((0, 0), |per_cpu| {
            per_cpu.iter().fold((0, 0), |(l, o), r| {
                (l + r.limited as u64, o + r.lost as u64)
            })
        })
    }
}

/// Service names by id, asked of `SERVICE_NAMES` once per heartbeat at most.
struct Names(HashMap<u32, Option<String>>);

impl Names {
    fn get(&mut self, pins: &Pins, id: u32) -> Option<String> {
        self.0
            .entry(id)
            .or_insert_with(|| {
                let name = pins.names.as_ref()?.get(&id, 0).ok()?;
                Some(String::from_utf8_lossy(name.text()).into_owned())
            })
            .clone()
    }
}

/// Whether `service` (`namespace/name:port`) is a port of `wanted`.
fn of_service(service: Option<&str>, wanted: &ObjectName) -> bool {
    service
        .and_then(|s| s.split_once(':'))
        .is_some_and(|(name, _)| name == format!("{}/{}", wanted.namespace, wanted.name))
}

/// Prints new flows until Ctrl-C, SIGTERM or `count` of them.
pub fn follow(f: Follow) -> Result<()> {
    let (mut pins, ring) = Pins::open(f.root)?;
    // What the ring holds from before this follower listened is not shown.
    let started_ns = monotonic_ns();
    pins.listen(f.rate)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (before_limited, before_lost) = pins.not_sent();
    let result = runtime.block_on(stream(&mut pins, ring, started_ns, &f));
    pins.stop();
    let (limited, lost) = pins.not_sent();
    let shown = result?;
    eprintln!(
        "{shown} flows shown; {} not sent (over {} per second on a CPU), {} lost (ring full)",
        limited.saturating_sub(before_limited),
        f.rate,
        lost.saturating_sub(before_lost)
    );
    Ok(())
}

async fn stream(
    pins: &mut Pins,
    ring: RingBuf<MapData>,
    started_ns: u64,
    f: &Follow<'_>,
) -> Result<u64> {
    let boot_unix_ns = SystemTime::now()
        .duration_since(UNIX_EPOCH)?
        .as_nanos()
        .saturating_sub(monotonic_ns() as u128) as u64;
    let mut stdout = std::io::stdout().lock();
    if f.output == Output::Table {
        stdout.write_all(FlowView::header().as_bytes())?;
        stdout.flush()?;
    }
    eprintln!(
        "following new flows on this node (at most {} per second per CPU); Ctrl-C stops",
        f.rate
    );
    let mut names = Names(HashMap::new());
    let mut heartbeat = tokio::time::interval(HEARTBEAT);
    let mut interrupt = tokio::signal::unix::signal(SignalKind::interrupt())?;
    let mut terminate = tokio::signal::unix::signal(SignalKind::terminate())?;
    // SAFETY: the RingBuf owns the map's fd and keeps it open while the AsyncFd holds it;
    // nothing else closes or replaces it.
    let mut ring = unsafe { AsyncFd::register_with_interest(ring, tokio::io::Interest::READABLE)? };
    let mut shown = 0u64;
    let mut done = false;
    let outcome = loop {
        tokio::select! {
            ready = ring.readable_mut() => {
                let mut guard = ready?;
                let events = guard.get_inner_mut();
                while let Some(item) = events.next() {
                    if item.len() < std::mem::size_of::<FlowEvent>() {
                        continue;
                    }
                    // SAFETY: the record holds a FlowEvent (length checked), unaligned at worst.
                    let event: FlowEvent =
                        unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) };
                    drop(item);
                    // Left in the ring by an earlier follower that stopped mid-batch.
                    if event.time_ns < started_ns {
                        continue;
                    }
                    let service = names.get(pins, event.service_id);
                    if f.service.is_some_and(|s| !of_service(service.as_deref(), s)) {
                        continue;
                    }
                    let view = FlowView::new(&event, boot_unix_ns, service);
                    let line = match f.output {
                        Output::Table => view.row(),
                        Output::Json => serde_json::to_string(&view)? + "\n",
                    };
                    // A closed pipe (`| head`) ends the follow quietly.
                    if stdout.write_all(line.as_bytes()).and_then(|_| stdout.flush()).is_err() {
                        done = true;
                        break;
                    }
                    shown += 1;
                    if f.count.is_some_and(|n| shown >= n) {
                        done = true;
                        break;
                    }
                }
                guard.clear_ready();
                if done {
                    break Ok(shown);
                }
            }
            _ = heartbeat.tick() => {
                if let Err(e) = pins.listen(f.rate) {
                    break Err(e);
                }
                names.0.clear();
            }
            _ = interrupt.recv() => break Ok(shown),
            _ = terminate.recv() => break Ok(shown),
        }
    };
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapped(v4: [u8; 4]) -> [u8; 16] {
        std::net::Ipv4Addr::from(v4).to_ipv6_mapped().octets()
    }

    fn event(path: u8, verdict: u8) -> FlowEvent {
        FlowEvent {
            time_ns: 1_000_000_000,
            client: mapped([10, 244, 1, 2]),
            frontend: mapped([10, 96, 0, 21]),
            backend: mapped([10, 244, 2, 3]),
            service_id: 7,
            backend_id: 3 | 1 << 16,
            client_port: 40112u16.to_be(),
            frontend_port: 80u16.to_be(),
            backend_port: 8080u16.to_be(),
            proto: proxy_common::IPPROTO_TCP,
            verdict,
            path,
            _pad0: 0,
            _pad1: 0,
            _pad2: 0,
        }
    }

    /// The three kinds a user meets: a packet's flow given a backend, a refusal, and an
    /// IPv6 socket's connect (no client yet).
    fn views() -> Vec<FlowView> {
        // 2026-12-07 10:41:06 UTC at monotonic 0.
        let boot = 1_796_640_066_000_000_000;
        let web = Some("lab/web:".to_string());
        let mut refused = event(FLOW_PATH_TC, FLOW_VERDICT_REFUSED);
        refused.backend_id = 0;
        refused.backend = [0; 16];
        refused.frontend = mapped([10, 96, 0, 22]);
        let mut socket = event(FLOW_PATH_SOCKET_POD, FLOW_VERDICT_FORWARDED);
        socket.client = [0; 16];
        socket.client_port = 0;
        socket.frontend = "fd00:96::15".parse::<Ipv6Addr>().unwrap().octets();
        socket.backend = "fd00:244:1::3".parse::<Ipv6Addr>().unwrap().octets();
        socket.time_ns += 892_000_000;
        vec![
            FlowView::new(
                &event(FLOW_PATH_TC, FLOW_VERDICT_FORWARDED),
                boot,
                web.clone(),
            ),
            FlowView::new(&refused, boot, Some("lab/dead:".into())),
            FlowView::new(&socket, boot, web),
        ]
    }

    #[test]
    fn table_and_json_lines() {
        let views = views();
        let table: String = std::iter::once(FlowView::header())
            .chain(views.iter().map(FlowView::row))
            .collect();
        crate::inspect::assert_golden("flows.txt", &table);
        let json: String = views
            .iter()
            .map(|v| serde_json::to_string(v).unwrap() + "\n")
            .collect();
        crate::inspect::assert_golden("flows.json", &json);
        assert_eq!(views[0].client.as_deref(), Some("10.244.1.2:40112"));
        assert_eq!(views[1].backend, None);
        assert_eq!(views[2].client, None);
        assert_eq!(views[2].frontend, "[fd00:96::15]:80");
    }

    #[test]
    fn service_filter_matches_the_object_not_a_prefix() {
        let web = ObjectName {
            namespace: "lab".into(),
            name: "web".into(),
        };
        assert!(of_service(Some("lab/web:http"), &web));
        assert!(of_service(Some("lab/web:"), &web));
        assert!(!of_service(Some("lab/web2:"), &web));
        assert!(!of_service(None, &web));
    }

    #[test]
    fn clock_is_utc_time_of_day() {
        assert_eq!(clock(1_796_640_066_112), "10:41:06.112");
    }
}
