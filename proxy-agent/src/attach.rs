//! Attaching the classifier to the node's interfaces: every interface whose name matches
//! `--interfaces`, including those created later (rtnetlink link events, not polling), and
//! again when an interface is re-created under the same name.

use std::{collections::HashMap, str::FromStr};

use anyhow::{bail, Context, Result};
use aya::programs::{
    tc::{self, NlOptions, TcAttachOptions},
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

use crate::datapath::Datapath;

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

fn link_event(msg: &LinkMessage, present: bool) -> Option<LinkEvent> {
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

/// Keeps the classifier attached to every matching interface.
pub struct Attacher {
    patterns: InterfacePatterns,
    mode: AttachMode,
    /// name -> ifindex the program is attached to.
    attached: HashMap<String, u32>,
}

impl Attacher {
    pub fn new(patterns: InterfacePatterns, mode: AttachMode) -> Self {
        Self {
            patterns,
            mode: mode.resolve(),
            attached: HashMap::new(),
        }
    }

    pub fn mode(&self) -> AttachMode {
        self.mode
    }

    pub fn attached(&self) -> impl Iterator<Item = (&String, &u32)> {
        self.attached.iter()
    }

    pub fn handle(&mut self, datapath: &mut Datapath, event: LinkEvent) {
        match event {
            LinkEvent::Present { name, ifindex } => {
                if !self.patterns.matches(&name) || self.attached.get(&name) == Some(&ifindex) {
                    return;
                }
                // A new ifindex under a known name: the interface was re-created and the
                // old attachment died with it.
                match self.attach(datapath, &name) {
                    Ok(()) => {
                        info!(interface = %name, ifindex, mode = ?self.mode, "attached");
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
            }
        }
    }

    fn attach(&self, datapath: &mut Datapath, name: &str) -> Result<()> {
        let prog: &mut SchedClassifier = datapath
            .ebpf
            .program_mut(program_names::TC_INGRESS)
            .context("eBPF object has no ingress program")?
            .try_into()?;
        let options = match self.mode {
            AttachMode::Tcx => TcAttachOptions::TcxOrder(LinkOrder::default()),
            AttachMode::Netlink => {
                if let Err(e) = tc::qdisc_add_clsact(name) {
                    // EEXIST: the qdisc is already there (ours from before, or a CNI's).
                    if !e.to_string().contains("exists") {
                        bail!("adding the clsact qdisc: {e}");
                    }
                }
                TcAttachOptions::Netlink(NlOptions::default())
            }
            AttachMode::Auto => unreachable!("resolved in new()"),
        };
        prog.attach_with_options(name, TcAttachType::Ingress, options)
            .with_context(|| format!("attaching to {name} ingress"))?;
        Ok(())
    }
}
