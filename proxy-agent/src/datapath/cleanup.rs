//! Removing the eBPF mode's state from this node's network namespace and bpffs root: TCX
//! links, tc filters and the qdiscs we added, pinned maps. Safe to run again; the other
//! modes' removal is in `agent::cleanup`.

use std::path::Path;

use anyhow::{Context, Result};
use aya::programs::{links::PinnedLink, tc, TcAttachType};
use futures::TryStreamExt;
use netlink_packet_route::tc::TcHandle;
use proxy_common::program_names;
use tracing::{info, warn};

use super::attach::{link_event, parse_interface_record};

/// What [`remove_datapath`] removed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct CleanupReport {
    pub links_unpinned: usize,
    pub filters_removed: usize,
    pub qdiscs_removed: usize,
    pub maps_unpinned: usize,
    /// Programs kept for the next start (`reuse`).
    pub programs_unpinned: usize,
}

/// Removes TCX links (by unpinning them), our netlink filters on every interface, the clsact
/// qdiscs the agent added (if nothing else uses them), the pinned maps and programs.
pub async fn remove_datapath(root: &Path) -> Result<CleanupReport> {
    let mut report = CleanupReport::default();

    // TCX links: a link lives while it is pinned or open; unpinning detaches it.
    let links = root.join("links");
    if let Ok(entries) = std::fs::read_dir(&links) {
        for entry in entries.flatten() {
            let path = entry.path();
            match PinnedLink::from_pin(&path) {
                Ok(link) => {
                    link.unpin()
                        .with_context(|| format!("unpinning {}", path.display()))?;
                }
                Err(_) => std::fs::remove_file(&path)
                    .with_context(|| format!("removing {}", path.display()))?,
            }
            report.links_unpinned += 1;
        }
    }

    // Netlink filters, wherever they are: found by program name on every interface.
    let (conn, handle, _) = rtnetlink::new_connection().context("opening an rtnetlink socket")?;
    tokio::spawn(conn);
    let mut interfaces = Vec::new();
    let mut dump = handle.link().get().execute();
    while let Some(msg) = dump.try_next().await.context("listing links")? {
        if let Some(crate::datapath::attach::LinkEvent::Present { name, ifindex }) =
            link_event(&msg, true)
        {
            interfaces.push((name, ifindex));
        }
    }
    for (name, _) in &interfaces {
        for (hook, program) in [
            (TcAttachType::Ingress, program_names::TC_INGRESS),
            (TcAttachType::Egress, program_names::TC_EGRESS),
        ] {
            match tc::qdisc_detach_program(name, hook, program) {
                Ok(()) => report.filters_removed += 1,
                Err(tc::TcError::IoError(e)) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => warn!(interface = %name, "removing our tc filter: {e}"),
            }
        }
    }

    // clsact qdiscs the agent added, recorded as `<name>@<ifindex>` directories; removed only
    // if no other filter (a CNI's) uses them now.
    let qdiscs = root.join("qdiscs");
    if let Ok(entries) = std::fs::read_dir(&qdiscs) {
        for entry in entries.flatten() {
            let record = entry.file_name().to_string_lossy().into_owned();
            let live = parse_interface_record(&record).and_then(|(name, idx)| {
                interfaces
                    .iter()
                    .any(|(n, i)| *n == name && *i == idx)
                    .then_some(idx)
            });
            if let Some(ifindex) = live {
                let mut others = 0;
                for hook in [TcHandle::MIN_INGRESS, TcHandle::MIN_EGRESS] {
                    let req = handle.traffic_filter(ifindex as i32).get();
                    let req = if hook == TcHandle::MIN_INGRESS {
                        req.ingress()
                    } else {
                        req.egress()
                    };
                    let filters: Vec<_> = req.execute().try_collect().await.unwrap_or_default();
                    others += filters.len();
                }
                if others == 0 {
                    let mut del = handle.qdisc().del(ifindex as i32);
                    del.message_mut().header.parent = TcHandle::CLSACT;
                    del.message_mut().header.handle = TcHandle {
                        major: 0xffff,
                        minor: 0,
                    };
                    match del.execute().await {
                        Ok(()) => report.qdiscs_removed += 1,
                        Err(e) => warn!(record = %record, "removing the clsact qdisc: {e}"),
                    }
                } else {
                    info!(record = %record, others, "clsact qdisc kept: other filters use it");
                }
            }
            let _ = std::fs::remove_dir(entry.path());
        }
    }

    // Maps: unpinning drops them once no program holds them any more.
    report.maps_unpinned = crate::datapath::pins::remove_files(&root.join("maps"))?;
    let programs = root.join("programs");
    report.programs_unpinned = crate::datapath::reuse::remove_all_but(&programs, None)?;
    for dir in ["links", "maps", "qdiscs", "programs"] {
        let _ = std::fs::remove_dir(root.join(dir));
    }
    let _ = std::fs::remove_dir(root);
    Ok(report)
}
