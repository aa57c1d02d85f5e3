//! Checks, before touching the kernel, that the agent holds the capabilities it needs, so a
//! missing one is one line naming it and the fix, not an EPERM deep in a BPF call.

use std::fmt;

pub const CAP_NET_ADMIN: u32 = 12;
pub const CAP_SYS_ADMIN: u32 = 21;
pub const CAP_BPF: u32 = 39;

/// The effective capability set of this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities(u64);

impl Capabilities {
    pub fn current() -> std::io::Result<Self> {
        #[repr(C)]
        struct Header {
            version: u32,
            pid: i32,
        }
        #[repr(C)]
        #[derive(Default, Clone, Copy)]
        struct Data {
            effective: u32,
            permitted: u32,
            inheritable: u32,
        }
        const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
        let mut header = Header {
            version: LINUX_CAPABILITY_VERSION_3,
            pid: 0,
        };
        let mut data = [Data::default(); 2];
        // SAFETY: capget with a v3 header writes two Data structs.
        let rc = unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Capabilities(
            data[0].effective as u64 | (data[1].effective as u64) << 32,
        ))
    }

    pub fn has(self, cap: u32) -> bool {
        self.0 & (1 << cap) != 0
    }
}

/// What the datapath needs: CAP_NET_ADMIN (attach to interfaces) and CAP_BPF (load programs
/// and maps; CAP_SYS_ADMIN also grants it, as on kernels before 5.8).
#[derive(Debug, PartialEq, Eq)]
pub struct MissingCapabilities(pub Vec<&'static str>);

impl fmt::Display for MissingCapabilities {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "missing {}: run proxy-agent as root, or grant them (Kubernetes: securityContext.capabilities.add: [BPF, NET_ADMIN]; a binary: setcap cap_bpf,cap_net_admin+ep)",
            self.0.join(" and ")
        )
    }
}

impl std::error::Error for MissingCapabilities {}

pub fn check_datapath(caps: Capabilities) -> Result<(), MissingCapabilities> {
    let mut missing = Vec::new();
    if !caps.has(CAP_BPF) && !caps.has(CAP_SYS_ADMIN) {
        missing.push("CAP_BPF");
    }
    if !caps.has(CAP_NET_ADMIN) {
        missing.push("CAP_NET_ADMIN");
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(MissingCapabilities(missing))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_exactly_what_is_missing() {
        let none = Capabilities(0);
        let err = check_datapath(none).unwrap_err();
        assert_eq!(err.0, vec!["CAP_BPF", "CAP_NET_ADMIN"]);
        assert!(err
            .to_string()
            .starts_with("missing CAP_BPF and CAP_NET_ADMIN: "));
        let net_only = Capabilities(1 << CAP_NET_ADMIN);
        assert_eq!(check_datapath(net_only).unwrap_err().0, vec!["CAP_BPF"]);
        let sys_admin = Capabilities(1 << CAP_NET_ADMIN | 1 << CAP_SYS_ADMIN);
        assert!(
            check_datapath(sys_admin).is_ok(),
            "CAP_SYS_ADMIN implies BPF"
        );
        let both = Capabilities(1 << CAP_NET_ADMIN | 1 << CAP_BPF);
        assert!(check_datapath(both).is_ok());
    }
}
