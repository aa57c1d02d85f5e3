//! Attaching the socket-level hooks to a cgroup: every process below it gets a backend
//! when its socket names a frontend (connect, sendmsg) and sees the frontend back (recvmsg,
//! getpeername). The node's own processes need them (their packets are routed before tc
//! sees them); pods below the cgroup save the per-packet translation. What the hooks do and
//! leave to tc is in the eBPF crate's `sock` module; the release hook gives back a
//! least-connection count when a socket closes, where the kernel lets it name the socket.
//!
//! Links are pinned beside the interface links (`links/cgroup-<program>`). A restarted agent
//! attaches its programs first and only then unpins its predecessor's, so the hooks are never
//! missing; for the moment both are attached, the second finds an address that is no longer
//! a frontend and leaves it alone.

use std::{fs::File, path::Path};

use anyhow::{Context, Result};
use aya::programs::{
    links::{FdLink, PinnedLink},
    CgroupAttachMode, CgroupSock, CgroupSockAddr,
};
use proxy_common::program_names;
use tracing::info;

use super::{features::KernelFeatures, pins::BpffsRoot, Datapath};

/// Whose sockets the hooks translate (`--socket-lb`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SocketLbScope {
    /// Every process below the cgroup.
    #[default]
    All,
    /// The node's network namespace only; pods' sockets are left to the tc path.
    HostOnly,
}

/// Attaches the socket hooks to the cgroup at `path` (a cgroup v2 directory; its
/// descendants are covered too): the eight address hooks, and the release hook where the
/// kernel lets it name a socket.
pub fn attach(datapath: &mut Datapath, path: &Path, root: Option<&BpffsRoot>) -> Result<()> {
    let cgroup = File::open(path).with_context(|| {
        format!(
            "opening cgroup {} (a cgroup v2 directory, e.g. /sys/fs/cgroup)",
            path.display()
        )
    })?;
    // Attaches program `$name`, of type `$program`, and keeps its link.
    macro_rules! attach_hook {
        ($program:ty, $name:expr) => {{
            let name = $name;
            let prog: &mut $program = datapath.program_mut(name)?.try_into()?;
            let id = prog
                .attach(&cgroup, CgroupAttachMode::Single)
                .with_context(|| format!("attaching {name} to cgroup {}", path.display()))?;
            let link = FdLink::try_from(prog.take_link(id)?).context(
                "the kernel attached a cgroup program without a link (kernel before 5.7?)",
            )?;
            keep(link, name, root)?;
        }};
    }
    for name in program_names::SOCKET_HOOKS {
        attach_hook!(CgroupSockAddr, name);
    }
    if KernelFeatures::get().sock_release_cookie {
        attach_hook!(CgroupSock, program_names::SOCK_RELEASE);
    }
    info!(cgroup = %path.display(), "socket hooks attached: processes below it get backends at connect time");
    Ok(())
}

/// Pins a hook's link (replacing its predecessor's), or keeps it for the process's life.
fn keep(link: FdLink, name: &str, root: Option<&BpffsRoot>) -> Result<()> {
    let Some(root) = root else {
        std::mem::forget(link);
        return Ok(());
    };
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
    Ok(())
}

/// `SO_NETNS_COOKIE` (5.14), the same on every architecture we build for.
const SO_NETNS_COOKIE: libc::c_int = 71;

/// The cookie of this process's network namespace, which the hooks take as the node's (the
/// agent runs in the host's network namespace, as the DaemonSet says). 0 where the kernel
/// cannot say (before 5.14): the hooks then take the kernel's initial namespace, which is
/// the host's on a real node.
pub fn own_netns_cookie() -> u64 {
    // SAFETY: plain socket calls on a descriptor this function owns and closes.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return 0;
        }
        let mut cookie: u64 = 0;
        let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
        let ok = libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            (&mut cookie as *mut u64).cast(),
            &mut len,
        ) == 0;
        libc::close(fd);
        if ok {
            cookie
        } else {
            tracing::warn!(
                "this kernel cannot tell a network namespace's cookie (SO_NETNS_COOKIE, 5.14+): the socket hooks take the initial network namespace as the node's"
            );
            0
        }
    }
}
