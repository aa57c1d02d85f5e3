//! Attaching the socket-level hooks to a cgroup, so the node's own processes and
//! host-network pods reach cluster IPs: their packets are routed before tc sees them, so the
//! frontend must be replaced by a backend when the socket names it (connect, sendmsg), and
//! shown back (recvmsg, getpeername).
//!
//! Links are pinned beside the interface links (`links/cgroup-<program>`). A restarted agent
//! attaches its programs first and only then unpins its predecessor's, so the hooks are never
//! missing; for the moment both are attached, the second finds an address that is no longer
//! a frontend and leaves it alone.

use std::{fs::File, path::Path};

use anyhow::{Context, Result};
use aya::programs::{
    links::{FdLink, PinnedLink},
    CgroupAttachMode, CgroupSockAddr,
};
use proxy_common::program_names;
use tracing::info;

use super::{pins::BpffsRoot, Datapath};

/// Attaches the four socket hooks to the cgroup at `path` (a cgroup v2 directory; its
/// descendants are covered too).
pub fn attach(datapath: &mut Datapath, path: &Path, root: Option<&BpffsRoot>) -> Result<()> {
    let cgroup = File::open(path).with_context(|| {
        format!(
            "opening cgroup {} (a cgroup v2 directory, e.g. /sys/fs/cgroup)",
            path.display()
        )
    })?;
    for name in program_names::SOCKET_HOOKS {
        let prog: &mut CgroupSockAddr = datapath
            .ebpf
            .program_mut(name)
            .with_context(|| format!("eBPF object has no program {name}"))?
            .try_into()?;
        let id = prog
            .attach(&cgroup, CgroupAttachMode::Single)
            .with_context(|| format!("attaching {name} to cgroup {}", path.display()))?;
        let link = FdLink::try_from(prog.take_link(id)?)
            .context("the kernel attached a cgroup program without a link (kernel before 5.7?)")?;
        match root {
            Some(root) => {
                let pin = root.links_dir().join(format!("cgroup-{name}"));
                if pin.exists() {
                    // The predecessor's hook goes only now that ours is attached.
                    if let Ok(old) = PinnedLink::from_pin(&pin) {
                        old.unpin()
                            .with_context(|| format!("unpinning {}", pin.display()))?;
                    } else {
                        let _ = std::fs::remove_file(&pin);
                    }
                }
                link.pin(&pin)
                    .with_context(|| format!("pinning {}", pin.display()))?;
            }
            None => std::mem::forget(link),
        }
    }
    info!(cgroup = %path.display(), "socket hooks attached: the node's own processes reach services");
    Ok(())
}
