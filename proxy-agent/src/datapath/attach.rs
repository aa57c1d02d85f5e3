//! Attaching the classifier to the node's interfaces: every interface whose name matches
//! `--interfaces`, including those created later (rtnetlink link events, not polling), and
//! again when an interface is re-created under the same name.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    str::FromStr,
};

use anyhow::{bail, Context, Result};
use aya::programs::{
    links::{FdLink, PinnedLink},
    tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle},
    LinkOrder, SchedClassifier, TcAttachType,
};
use futures::TryStreamExt;
use netlink_packet_route::{
    link::{LinkAttribute, LinkMessage},
    RouteNetlinkMessage,
};
use netlink_sys::{AsyncSocket, SocketAddr};
use proxy_common::program_names;
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::{pins::BpffsRoot, Datapath};

/// How the classifier is attached: TCX links (kernel 6.6+, ordered with other programs, "next"
/// passes to them) or a clsact qdisc with a direct-action filter (older kernels).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachMode {
    Tcx,
    Netlink,
    Auto,
}

impl FromStr for AttachMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "tcx" => Ok(AttachMode::Tcx),
            "netlink" => Ok(AttachMode::Netlink),
            "auto" => Ok(AttachMode::Auto),
            other => Err(format!(
                "unknown attach mode {other:?} (expected tcx, netlink or auto)"
            )),
        }
    }
}

impl AttachMode {
    /// The mode actually used on this kernel.
    pub fn resolve(self) -> AttachMode {
        let tcx_kernel = aya::util::KernelVersion::current()
            .map(|v| v >= aya::util::KernelVersion::new(6, 6, 0))
            .unwrap_or(false);
        match self {
            AttachMode::Auto if tcx_kernel => AttachMode::Tcx,
            AttachMode::Auto => AttachMode::Netlink,
            other => other,
        }
    }
}

/// Interface name patterns from `--interfaces` (comma-separated globs).
#[derive(Clone, Debug)]
pub struct InterfacePatterns(Vec<glob::Pattern>);

impl FromStr for InterfacePatterns {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut patterns = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            patterns.push(
                glob::Pattern::new(part)
                    .map_err(|e| format!("--interfaces: {part:?} is not a valid glob: {e}"))?,
            );
        }
        if patterns.is_empty() {
            return Err("--interfaces needs at least one pattern".into());
        }
        Ok(InterfacePatterns(patterns))
    }
}

impl InterfacePatterns {
    pub fn matches(&self, name: &str) -> bool {
        self.0.iter().any(|p| p.matches(name))
    }
}

/// A link appeared (or changed) or went away.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkEvent {
    Present { name: String, ifindex: u32 },
    Gone { name: String, ifindex: u32 },
}

pub fn link_event(msg: &LinkMessage, present: bool) -> Option<LinkEvent> {
    let name = msg.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfName(n) => Some(n.clone()),
        _ => None,
    })?;
    let ifindex = msg.header.index;
    Some(if present {
        LinkEvent::Present { name, ifindex }
    } else {
        LinkEvent::Gone { name, ifindex }
    })
}

/// Streams the current links, then every change, of the agent's network namespace.
pub async fn watch_links(tx: mpsc::Sender<LinkEvent>) -> Result<()> {
    let (mut conn, handle, mut messages) =
        rtnetlink::new_connection().context("opening an rtnetlink socket")?;
    conn.socket_mut()
        .socket_mut()
        .bind(&SocketAddr::new(0, rtnetlink::constants::RTMGRP_LINK))
        .context("subscribing to rtnetlink link events")?;
    tokio::spawn(conn);
    // Subscribe before dumping, so a link created in between is not missed.
    let mut dump = handle.link().get().execute();
    while let Some(msg) = dump.try_next().await.context("listing links")? {
        if let Some(ev) = link_event(&msg, true) {
            if tx.send(ev).await.is_err() {
                return Ok(());
            }
        }
    }
    use futures::StreamExt;
    while let Some((message, _)) = messages.next().await {
        let ev = match message.payload {
            netlink_packet_core::NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(l)) => {
                link_event(&l, true)
            }
            netlink_packet_core::NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelLink(l)) => {
                link_event(&l, false)
            }
            _ => None,
        };
        if let Some(ev) = ev {
            if tx.send(ev).await.is_err() {
                return Ok(());
            }
        }
    }
    Ok(())
}

/// Priority and handle of our filter in netlink (clsact) mode. Fixed, so a restarted agent
/// finds the filter its predecessor left and replaces its program in place.
pub const NETLINK_PRIORITY: u16 = 1;
pub const NETLINK_HANDLE: TcHandle = TcHandle::new(0, 0x4b50);

/// Keeps the classifier attached to every matching interface.
///
/// Attachments outlive the agent: TCX links are pinned under `links_dir`, netlink filters
/// persist in the kernel by themselves. An agent that finds its predecessor's attachment
/// swaps the program in it atomically (`bpf_link_update`, or a filter replace at the same
/// priority and handle), so no packet meets an interface without the classifier.
pub struct Attacher {
    patterns: InterfacePatterns,
    mode: AttachMode,
    links_dir: Option<PathBuf>,
    /// Where clsact qdiscs this agent added are recorded (as `<name>@<ifindex>` directories).
    qdiscs_dir: Option<PathBuf>,
    /// name -> ifindex the program is attached to.
    attached: HashMap<String, u32>,
}

/// What attaching to one interface did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attached {
    New,
    /// A previous agent's attachment now runs this agent's program.
    Replaced,
}

impl Attacher {
    pub fn new(patterns: InterfacePatterns, mode: AttachMode, root: Option<&BpffsRoot>) -> Self {
        Self {
            patterns,
            mode: mode.resolve(),
            links_dir: root.map(BpffsRoot::links_dir),
            qdiscs_dir: root.map(BpffsRoot::qdiscs_dir),
            attached: HashMap::new(),
        }
    }

    pub fn handle(&mut self, datapath: &mut Datapath, event: LinkEvent) {
        match event {
            LinkEvent::Present { name, ifindex } => {
                if !self.patterns.matches(&name) || self.attached.get(&name) == Some(&ifindex) {
                    return;
                }
                // A new ifindex under a known name: the interface was re-created and the
                // old attachment died with it.
                match self.attach(datapath, &name, ifindex) {
                    Ok(how) => {
                        info!(interface = %name, ifindex, mode = ?self.mode, ?how, "attached");
                        self.attached.insert(name, ifindex);
                    }
                    Err(e) => warn!(interface = %name, "not attached: {e:#}"),
                }
            }
            LinkEvent::Gone { name, ifindex } => {
                if self.attached.get(&name) == Some(&ifindex) {
                    info!(interface = %name, "interface gone");
                    self.attached.remove(&name);
                }
                if let Some(dir) = &self.links_dir {
                    for direction in ["ingress", "egress"] {
                        let _ = std::fs::remove_file(link_pin(dir, &name, ifindex, direction));
                    }
                }
            }
        }
    }

    /// Attaches the ingress and the egress program; "replaced" when both were.
    fn attach(&self, datapath: &mut Datapath, name: &str, ifindex: u32) -> Result<Attached> {
        let ingress = self.attach_one(datapath, name, ifindex, TcAttachType::Ingress)?;
        let egress = self.attach_one(datapath, name, ifindex, TcAttachType::Egress)?;
        Ok(
            if ingress == Attached::Replaced && egress == Attached::Replaced {
                Attached::Replaced
            } else {
                Attached::New
            },
        )
    }

    fn attach_one(
        &self,
        datapath: &mut Datapath,
        name: &str,
        ifindex: u32,
        hook: TcAttachType,
    ) -> Result<Attached> {
        let (program, direction) = match hook {
            TcAttachType::Egress => (program_names::TC_EGRESS, "egress"),
            _ => (program_names::TC_INGRESS, "ingress"),
        };
        let prog: &mut SchedClassifier = datapath.program_mut(program)?.try_into()?;
        match self.mode {
            AttachMode::Tcx => {
                let pin = self
                    .links_dir
                    .as_ref()
                    .map(|d| link_pin(d, name, ifindex, direction));
                if let Some(pin) = pin.as_ref().filter(|p| p.exists()) {
                    let link = PinnedLink::from_pin(pin)
                        .with_context(|| format!("opening {}", pin.display()))?;
                    let link = SchedClassifierLink::try_from(FdLink::from(link))?;
                    let id = prog
                        .attach_to_link(link)
                        .with_context(|| format!("replacing the program on {name} {direction}"))?;
                    // The pin keeps the link; dropping our handle only closes an fd.
                    drop(prog.take_link(id)?);
                    return Ok(Attached::Replaced);
                }
                if let Some(dir) = &self.links_dir {
                    remove_stale_pins(dir, name, direction);
                }
                let id = prog
                    .attach_with_options(
                        name,
                        hook,
                        TcAttachOptions::TcxOrder(LinkOrder::default()),
                    )
                    .with_context(|| format!("attaching to {name} {direction} (TCX)"))?;
                let link = FdLink::try_from(prog.take_link(id)?)?;
                match pin {
                    Some(pin) => {
                        link.pin(&pin)
                            .with_context(|| format!("pinning the link at {}", pin.display()))?;
                    }
                    // Without a bpffs root the attachment lives as long as the agent.
                    None => std::mem::forget(link),
                }
                Ok(Attached::New)
            }
            AttachMode::Netlink => {
                match tc::qdisc_add_clsact(name) {
                    // Remember that the qdisc is ours, so --cleanup removes it (and only it).
                    Ok(()) => {
                        if let Some(dir) = &self.qdiscs_dir {
                            let _ =
                                std::fs::create_dir_all(dir.join(interface_record(name, ifindex)));
                        }
                    }
                    // EEXIST: there already is one (a CNI's, or ours from before).
                    Err(tc::TcError::NetlinkError(e)) if e.raw_os_error() == Some(libc::EEXIST) => {
                    }
                    Err(e) => bail!("adding the clsact qdisc to {name}: {e}"),
                }
                let existing = SchedClassifierLink::attached(
                    name,
                    hook,
                    NETLINK_PRIORITY,
                    NETLINK_HANDLE,
                    None,
                )?;
                let (id, how) = match prog.attach_to_link(existing) {
                    Ok(id) => (id, Attached::Replaced),
                    Err(_) => {
                        let options = NlOptions {
                            priority: NETLINK_PRIORITY,
                            handle: NETLINK_HANDLE,
                            classid: None,
                        };
                        let id = prog
                            .attach_with_options(name, hook, TcAttachOptions::Netlink(options))
                            .with_context(|| {
                                format!("attaching to {name} {direction} (netlink)")
                            })?;
                        (id, Attached::New)
                    }
                };
                // Filters stay in the kernel after the agent exits; dropping the link would
                // detach it.
                std::mem::forget(prog.take_link(id)?);
                Ok(how)
            }
            AttachMode::Auto => unreachable!("resolved in new()"),
        }
    }
}

/// `<links>/<interface>@<ifindex>-<ingress|egress>`: the ifindex tells a live attachment
/// from one that died with a deleted interface of the same name.
pub fn link_pin(dir: &Path, name: &str, ifindex: u32, direction: &str) -> PathBuf {
    dir.join(format!("{}-{direction}", interface_record(name, ifindex)))
}

/// `<interface>@<ifindex>` as a bpffs file name: bpffs refuses names with dots (reserved by
/// the kernel), which interface names may have (`eth0.100`).
pub fn interface_record(name: &str, ifindex: u32) -> String {
    format!("{}@{ifindex}", name.replace('.', "%2e"))
}

/// The inverse of [`interface_record`] (ignoring any `-suffix`).
pub fn parse_interface_record(record: &str) -> Option<(String, u32)> {
    let (name, rest) = record.rsplit_once('@')?;
    let index = rest.split('-').next()?.parse().ok()?;
    Some((name.replace("%2e", "."), index))
}

fn remove_stale_pins(dir: &Path, name: &str, direction: &str) {
    let prefix = format!("{}@", name.replace('.', "%2e"));
    let suffix = format!("-{direction}");
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let file = e.file_name().to_string_lossy().into_owned();
            if file.starts_with(&prefix) && file.ends_with(&suffix) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_records_are_valid_bpffs_names_and_round_trip() {
        for (name, index) in [("lxc0", 3), ("eth0.100", 17), ("a.b.c", 1)] {
            let record = interface_record(name, index);
            assert!(!record.contains('.'), "{record}");
            assert_eq!(
                parse_interface_record(&record),
                Some((name.to_string(), index))
            );
            let pin = link_pin(Path::new("/x"), name, index, "egress");
            let file = pin.file_name().unwrap().to_str().unwrap();
            assert!(!file.contains('.'), "{file}");
            assert_eq!(
                parse_interface_record(file),
                Some((name.to_string(), index))
            );
        }
    }

    #[test]
    fn interface_patterns_are_comma_separated_globs() {
        let p: InterfacePatterns = "lxc*, eth0".parse().unwrap();
        assert!(p.matches("lxc12") && p.matches("eth0"));
        assert!(!p.matches("eth1") && !p.matches("veth0"));
        assert!("".parse::<InterfacePatterns>().is_err());
        assert!("["
            .parse::<InterfacePatterns>()
            .unwrap_err()
            .contains("not a valid glob"));
    }
}
