//! The kernel's conntrack tuning that kube-proxy does at start (`conntrack.*` of
//! KubeProxyConfiguration): `nf_conntrack_max` (with the hash table grown to a quarter of
//! it), the TCP established / close-wait timeouts, `tcp_be_liberal` and the UDP timeouts.
//! Nodes that ran kube-proxy have these set at run time only; without them a node reverts to
//! the kernel's defaults after a reboot (a 5-day established timeout, a table sized from
//! memory), which is the "nf_conntrack: table full" class of outage operators tuned away.
//!
//! Applied only in the initial network namespace, where the table size is writable: the
//! kernel makes `nf_conntrack_max` read-only in every other namespace, and the agent reads
//! that as "not the node's own network stack" (a lab, a test, a pod without hostNetwork).

use std::{
    fs,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, Result};

/// What to set; zero means "leave the kernel's value", as in kube-proxy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConntrackSysctls {
    pub max_per_core: u32,
    pub min: u32,
    pub tcp_established_timeout: Duration,
    pub tcp_close_wait_timeout: Duration,
    pub tcp_be_liberal: bool,
    pub udp_timeout: Duration,
    pub udp_stream_timeout: Duration,
}

impl Default for ConntrackSysctls {
    /// kube-proxy's defaults (v1alpha1 defaulting and its flags).
    fn default() -> Self {
        Self {
            max_per_core: 32 * 1024,
            min: 128 * 1024,
            tcp_established_timeout: Duration::from_secs(24 * 3600),
            tcp_close_wait_timeout: Duration::from_secs(3600),
            tcp_be_liberal: false,
            udp_timeout: Duration::ZERO,
            udp_stream_timeout: Duration::ZERO,
        }
    }
}

/// One value to write, relative to the filesystem root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SysctlWrite {
    pub path: &'static str,
    pub value: u64,
}

const NETFILTER: &str = "proc/sys/net/netfilter";
const MAX: &str = "proc/sys/net/netfilter/nf_conntrack_max";
const HASHSIZE: &str = "sys/module/nf_conntrack/parameters/hashsize";

impl ConntrackSysctls {
    /// kube-proxy's rule: max(maxPerCore x CPUs, min), or nothing when maxPerCore is 0.
    pub fn table_size(&self, cpus: u32) -> Option<u64> {
        (self.max_per_core > 0)
            .then(|| (self.max_per_core as u64 * cpus as u64).max(self.min as u64))
    }

    /// The writes, in order. The hash table only grows (to a quarter of the table size, as
    /// kube-proxy does), since shrinking it rehashes every tracked connection.
    pub fn plan(&self, cpus: u32, current_hashsize: Option<u64>) -> Vec<SysctlWrite> {
        let mut writes = Vec::new();
        if let Some(max) = self.table_size(cpus) {
            writes.push(SysctlWrite {
                path: MAX,
                value: max,
            });
            if current_hashsize.is_some_and(|h| h < max / 4) {
                writes.push(SysctlWrite {
                    path: HASHSIZE,
                    value: max / 4,
                });
            }
        }
        let mut seconds = |name: &'static str, d: Duration| {
            if !d.is_zero() {
                writes.push(SysctlWrite {
                    path: name,
                    value: d.as_secs().max(1),
                });
            }
        };
        seconds(
            "proc/sys/net/netfilter/nf_conntrack_tcp_timeout_established",
            self.tcp_established_timeout,
        );
        seconds(
            "proc/sys/net/netfilter/nf_conntrack_tcp_timeout_close_wait",
            self.tcp_close_wait_timeout,
        );
        seconds(
            "proc/sys/net/netfilter/nf_conntrack_udp_timeout",
            self.udp_timeout,
        );
        seconds(
            "proc/sys/net/netfilter/nf_conntrack_udp_timeout_stream",
            self.udp_stream_timeout,
        );
        if self.tcp_be_liberal {
            writes.push(SysctlWrite {
                path: "proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal",
                value: 1,
            });
        }
        writes
    }
}

/// What [`apply`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Values written (path, old, new); unchanged values are not listed.
    Applied(Vec<(String, String, u64)>),
    /// Not the initial network namespace: nothing touched.
    NotInitialNamespace,
    /// No conntrack in this kernel (module not loaded): nothing to tune.
    NoConntrack,
}

/// Applies `tuning` under `root` ("/" on a node).
pub fn apply(root: &Path, tuning: &ConntrackSysctls, cpus: u32) -> Result<Outcome> {
    let netfilter = root.join(NETFILTER);
    let max = root.join(MAX);
    if !netfilter.is_dir() || !max.exists() {
        return Ok(Outcome::NoConntrack);
    }
    let mode = fs::metadata(&max)
        .with_context(|| format!("reading {}", max.display()))?
        .permissions()
        .mode();
    if mode & 0o200 == 0 {
        return Ok(Outcome::NotInitialNamespace);
    }
    let hashsize = read_number(&root.join(HASHSIZE));
    let mut changed = Vec::new();
    for write in tuning.plan(cpus, hashsize) {
        let path: PathBuf = root.join(write.path);
        let old = fs::read_to_string(&path).unwrap_or_default();
        if old.trim() == write.value.to_string() {
            continue;
        }
        fs::write(&path, write.value.to_string()).map_err(|e| {
            let hint = if e.raw_os_error() == Some(libc::EROFS) {
                " (/proc/sys or /sys is read-only in this container: run it privileged, as kube-proxy runs, or set conntrack.maxPerCore and the conntrack timeouts to 0 to leave the kernel's conntrack alone)"
            } else {
                ""
            };
            anyhow::anyhow!("writing {} to /{}: {e}{hint}", write.value, write.path)
        })?;
        changed.push((write.path.to_string(), old.trim().to_string(), write.value));
    }
    Ok(Outcome::Applied(changed))
}

fn read_number(path: &Path) -> Option<u64> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_root(max_mode: u32) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        let nf = root.path().join(NETFILTER);
        fs::create_dir_all(&nf).unwrap();
        for (name, value) in [
            ("nf_conntrack_max", "262144"),
            ("nf_conntrack_tcp_timeout_established", "432000"),
            ("nf_conntrack_tcp_timeout_close_wait", "60"),
            ("nf_conntrack_udp_timeout", "30"),
            ("nf_conntrack_udp_timeout_stream", "120"),
            ("nf_conntrack_tcp_be_liberal", "0"),
        ] {
            fs::write(nf.join(name), value).unwrap();
        }
        fs::set_permissions(
            nf.join("nf_conntrack_max"),
            fs::Permissions::from_mode(max_mode),
        )
        .unwrap();
        let params = root.path().join("sys/module/nf_conntrack/parameters");
        fs::create_dir_all(&params).unwrap();
        fs::write(params.join("hashsize"), "65536").unwrap();
        root
    }

    fn read(root: &Path, rel: &str) -> String {
        fs::read_to_string(root.join(rel)).unwrap()
    }

    #[test]
    fn kube_proxy_defaults_size_the_table_per_cpu_and_set_tcp_timeouts() {
        let root = fake_root(0o644);
        let tuning = ConntrackSysctls::default();
        // 8 CPUs x 32768 = 262144 (equal: unchanged); 16 CPUs: 524288, hash grows to 131072.
        let outcome = apply(root.path(), &tuning, 16).unwrap();
        let Outcome::Applied(changed) = outcome else {
            panic!("{outcome:?}")
        };
        let paths: Vec<&str> = changed.iter().map(|(p, _, _)| p.as_str()).collect();
        assert_eq!(
            paths,
            [
                MAX,
                HASHSIZE,
                "proc/sys/net/netfilter/nf_conntrack_tcp_timeout_established",
                "proc/sys/net/netfilter/nf_conntrack_tcp_timeout_close_wait",
            ]
        );
        assert_eq!(read(root.path(), MAX), "524288");
        assert_eq!(read(root.path(), HASHSIZE), "131072");
        assert_eq!(
            read(
                root.path(),
                "proc/sys/net/netfilter/nf_conntrack_tcp_timeout_established"
            ),
            "86400"
        );
        // UDP timeouts default to "leave".
        assert_eq!(
            read(
                root.path(),
                "proc/sys/net/netfilter/nf_conntrack_udp_timeout"
            ),
            "30"
        );
        // A second run finds nothing to change.
        assert_eq!(
            apply(root.path(), &tuning, 16).unwrap(),
            Outcome::Applied(vec![])
        );
    }

    #[test]
    fn min_wins_on_small_nodes_and_zero_leaves_the_kernel_alone() {
        let tuning = ConntrackSysctls::default();
        assert_eq!(tuning.table_size(2), Some(131072));
        let leave = ConntrackSysctls {
            max_per_core: 0,
            tcp_established_timeout: Duration::ZERO,
            tcp_close_wait_timeout: Duration::ZERO,
            ..tuning
        };
        assert_eq!(leave.plan(64, Some(1024)), vec![]);
    }

    #[test]
    fn the_hash_table_only_grows_and_liberal_and_udp_are_set_when_asked() {
        let tuning = ConntrackSysctls {
            tcp_be_liberal: true,
            udp_timeout: Duration::from_secs(20),
            udp_stream_timeout: Duration::from_millis(90_500),
            ..ConntrackSysctls::default()
        };
        let plan = tuning.plan(2, Some(1 << 20));
        assert!(plan.iter().all(|w| w.path != HASHSIZE), "{plan:?}");
        let value = |p: &str| plan.iter().find(|w| w.path.ends_with(p)).map(|w| w.value);
        assert_eq!(value("nf_conntrack_tcp_be_liberal"), Some(1));
        assert_eq!(value("nf_conntrack_udp_timeout"), Some(20));
        assert_eq!(value("nf_conntrack_udp_timeout_stream"), Some(90));
    }

    #[test]
    fn outside_the_initial_namespace_nothing_is_written() {
        // The kernel makes nf_conntrack_max read-only in every other network namespace.
        let root = fake_root(0o444);
        let outcome = apply(root.path(), &ConntrackSysctls::default(), 16).unwrap();
        assert_eq!(outcome, Outcome::NotInitialNamespace);
        assert_eq!(
            read(
                root.path(),
                "proc/sys/net/netfilter/nf_conntrack_tcp_timeout_established"
            ),
            "432000"
        );
    }

    #[test]
    fn without_conntrack_there_is_nothing_to_tune() {
        let root = tempfile::tempdir().unwrap();
        let outcome = apply(root.path(), &ConntrackSysctls::default(), 4).unwrap();
        assert_eq!(outcome, Outcome::NoConntrack);
    }
}
