//! Checks, before touching the kernel, that the agent holds the capabilities it needs, so a
//! missing one is one line naming it and the fix, not an EPERM deep in a BPF call.

use std::fmt;

pub const CAP_NET_BIND_SERVICE: u32 = 10;
pub const CAP_NET_ADMIN: u32 = 12;
pub const CAP_SYS_ADMIN: u32 = 21;
pub const CAP_PERFMON: u32 = 38;
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

/// What the datapath needs: CAP_NET_ADMIN (attach to interfaces), CAP_BPF (load programs
/// and maps) and CAP_PERFMON (without it the verifier holds the programs to the rules for
/// unprivileged ones and refuses the classifier); CAP_SYS_ADMIN grants both, as on kernels
/// before 5.8.
#[derive(Debug, PartialEq, Eq)]
pub struct MissingCapabilities(pub Vec<&'static str>);

impl fmt::Display for MissingCapabilities {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let short: Vec<&str> = self
            .0
            .iter()
            .map(|c| c.trim_start_matches("CAP_"))
            .collect();
        let names = match self.0.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
            _ => self.0.join(""),
        };
        write!(
            f,
            "missing {names}: run proxy-agent as root, or grant them (Kubernetes: securityContext.capabilities.add: [{}]; a binary: setcap {}+ep)",
            short.join(", "),
            self.0.join(",").to_lowercase()
        )
    }
}

impl std::error::Error for MissingCapabilities {}

///
/// `needs_bpf`: false for the netfilter modes (and `auto`, which then falls back to them),
/// which need only CAP_NET_ADMIN, so they run on kernels and in pods without BPF rights.
/// `binds_service_ports`: the userspace mode listens on the services' own ports, most of
/// them below 1024, which takes CAP_NET_BIND_SERVICE.
pub fn check_datapath(
    caps: Capabilities,
    needs_bpf: bool,
    binds_service_ports: bool,
) -> Result<(), MissingCapabilities> {
    let mut missing = Vec::new();
    if needs_bpf && !caps.has(CAP_BPF) && !caps.has(CAP_SYS_ADMIN) {
        missing.push("CAP_BPF");
    }
    if needs_bpf && !caps.has(CAP_PERFMON) && !caps.has(CAP_SYS_ADMIN) {
        missing.push("CAP_PERFMON");
    }
    if !caps.has(CAP_NET_ADMIN) {
        missing.push("CAP_NET_ADMIN");
    }
    if binds_service_ports && !caps.has(CAP_NET_BIND_SERVICE) {
        missing.push("CAP_NET_BIND_SERVICE");
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
        let err = check_datapath(none, true, false).unwrap_err();
        assert_eq!(err.0, vec!["CAP_BPF", "CAP_PERFMON", "CAP_NET_ADMIN"]);
        assert_eq!(
            err.to_string(),
            "missing CAP_BPF, CAP_PERFMON and CAP_NET_ADMIN: run proxy-agent as root, or grant them (Kubernetes: securityContext.capabilities.add: [BPF, PERFMON, NET_ADMIN]; a binary: setcap cap_bpf,cap_perfmon,cap_net_admin+ep)"
        );
        let net_only = Capabilities(1 << CAP_NET_ADMIN);
        assert_eq!(
            check_datapath(net_only, true, false).unwrap_err().0,
            vec!["CAP_BPF", "CAP_PERFMON"]
        );
        let without_perfmon = Capabilities(1 << CAP_NET_ADMIN | 1 << CAP_BPF);
        assert_eq!(
            check_datapath(without_perfmon, true, false).unwrap_err().to_string(),
            "missing CAP_PERFMON: run proxy-agent as root, or grant them (Kubernetes: securityContext.capabilities.add: [PERFMON]; a binary: setcap cap_perfmon+ep)"
        );
        let sys_admin = Capabilities(1 << CAP_NET_ADMIN | 1 << CAP_SYS_ADMIN);
        assert!(
            check_datapath(sys_admin, true, false).is_ok(),
            "CAP_SYS_ADMIN implies BPF"
        );
        let all = Capabilities(1 << CAP_NET_ADMIN | 1 << CAP_BPF | 1 << CAP_PERFMON);
        assert!(check_datapath(all, true, false).is_ok());
        // The netfilter modes need CAP_NET_ADMIN only.
        assert!(check_datapath(net_only, false, false).is_ok());
        assert_eq!(
            check_datapath(none, false, false).unwrap_err().0,
            vec!["CAP_NET_ADMIN"]
        );
        // The userspace mode binds the services' ports.
        assert_eq!(
            check_datapath(net_only, false, true).unwrap_err().0,
            vec!["CAP_NET_BIND_SERVICE"]
        );
        let userspace = Capabilities(1 << CAP_NET_ADMIN | 1 << CAP_NET_BIND_SERVICE);
        assert!(check_datapath(userspace, false, true).is_ok());
    }
}
