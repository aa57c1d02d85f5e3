//! The ipsets the ipvs mode's iptables rules match against (kube-proxy's design: a fixed
//! handful of rules, one set lookup each, however many services there are), written with
//! `ipset restore`: whole sets swapped in atomically on full syncs, single entries added
//! and deleted otherwise.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    process::Command,
};

use anyhow::{bail, Context, Result};

use crate::{kernel::command, model::IpFamily};

/// The sets, by role. Names are kube-proxy's where the role is the same; IPv6 sets carry
/// `-6` after `KUBE` (`KUBE-6-CLUSTER-IP`), as kube-proxy's do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SetKind {
    /// Every cluster IP frontend (`ip,proto:port`).
    ClusterIp,
    /// Every external frontend: node ports (per node address), external and LB IPs.
    External,
    /// Frontends of `masqueradeAll`: every flow source-NATed.
    MasqueradeAll,
    /// External frontends under `externalTrafficPolicy: Cluster`: masqueraded when the
    /// flow leaves the node for an endpoint on another node.
    ExternalMasquerade,
    /// Endpoints on other nodes (`ip,proto:port`) of those frontends.
    RemoteEndpoint,
    /// Hairpin: `endpoint,proto:port,endpoint` (a pod reaching itself is masqueraded).
    LoopBack,
}

impl SetKind {
    pub const ALL: [SetKind; 6] = [
        SetKind::ClusterIp,
        SetKind::External,
        SetKind::MasqueradeAll,
        SetKind::ExternalMasquerade,
        SetKind::RemoteEndpoint,
        SetKind::LoopBack,
    ];

    fn base(self) -> &'static str {
        match self {
            SetKind::ClusterIp => "CLUSTER-IP",
            SetKind::External => "EXTERNAL-SERVICE",
            SetKind::MasqueradeAll => "MASQUERADE-ALL",
            SetKind::ExternalMasquerade => "EXTERNAL-MASQ",
            SetKind::RemoteEndpoint => "REMOTE-ENDPOINT",
            SetKind::LoopBack => "LOOP-BACK",
        }
    }

    pub fn name(self, family: IpFamily) -> String {
        match family {
            IpFamily::V4 => format!("KUBE-{}", self.base()),
            IpFamily::V6 => format!("KUBE-6-{}", self.base()),
        }
    }

    fn set_type(self) -> &'static str {
        match self {
            SetKind::LoopBack => "hash:ip,port,ip",
            _ => "hash:ip,port",
        }
    }
}

/// The desired entries of each set of one family.
pub type SetEntries = BTreeMap<SetKind, BTreeSet<String>>;

/// Runs `ipset restore` input.
pub trait IpSets: Send {
    fn restore(&mut self, input: &str) -> Result<()>;
    /// Every set's name on this node.
    fn names(&mut self) -> Result<Vec<String>>;
}

/// The `ipset` command.
#[derive(Clone, Copy, Debug, Default)]
pub struct IpsetCommand;

impl IpsetCommand {
    /// Whether `ipset` runs and the kernel has ip_set.
    pub fn probe(&self) -> Result<()> {
        let out = command::run(
            Command::new("ipset").args(["list", "-n"]),
            None,
            command::PROBE_TIMEOUT,
        )
        .context("running ipset (install the ipset package)")?;
        if !out.status.success() {
            bail!(
                "ipset list failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }
}

impl IpSets for IpsetCommand {
    fn restore(&mut self, input: &str) -> Result<()> {
        let out = command::run(
            Command::new("ipset").args(["-exist", "restore"]),
            Some(input.as_bytes()),
            command::RULESET_TIMEOUT,
        )
        .context("running ipset restore (install the ipset package)")?;
        if !out.status.success() {
            bail!(
                "ipset restore failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    fn names(&mut self) -> Result<Vec<String>> {
        let out = command::run(
            Command::new("ipset").args(["list", "-n"]),
            None,
            command::RULESET_TIMEOUT,
        )
        .context("running ipset list")?;
        if !out.status.success() {
            bail!(
                "ipset list failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect())
    }
}

fn create_line(out: &mut String, name: &str, kind: SetKind, family: IpFamily) {
    let family = match family {
        IpFamily::V4 => "inet",
        IpFamily::V6 => "inet6",
    };
    let _ = writeln!(out, "create {name} {} family {family}", kind.set_type());
}

/// Restore input that makes `family`'s sets hold exactly `wanted`: each set filled under a
/// temporary name and swapped in, so no lookup ever sees it half written.
pub fn full_input(family: IpFamily, wanted: &SetEntries) -> String {
    let mut out = String::new();
    for kind in SetKind::ALL {
        let name = kind.name(family);
        let temp = format!("{name}-NEW");
        create_line(&mut out, &name, kind, family);
        create_line(&mut out, &temp, kind, family);
        let _ = writeln!(out, "flush {temp}");
        for entry in wanted.get(&kind).into_iter().flatten() {
            let _ = writeln!(out, "add {temp} {entry}");
        }
        let _ = writeln!(out, "swap {temp} {name}");
        let _ = writeln!(out, "destroy {temp}");
    }
    out
}

/// Restore input that turns `written` into `wanted` entry by entry; empty when they agree.
pub fn change_input(family: IpFamily, written: &SetEntries, wanted: &SetEntries) -> String {
    let mut out = String::new();
    let none = BTreeSet::new();
    for kind in SetKind::ALL {
        let name = kind.name(family);
        let (old, new) = (
            written.get(&kind).unwrap_or(&none),
            wanted.get(&kind).unwrap_or(&none),
        );
        for entry in old.difference(new) {
            let _ = writeln!(out, "del {name} {entry}");
        }
        for entry in new.difference(old) {
            let _ = writeln!(out, "add {name} {entry}");
        }
    }
    out
}

/// Restore input destroying every `KUBE-` set in `names` (after the rules using them are
/// gone; kube-proxy's ipvs mode's sets too).
pub fn removal_input(names: &[String]) -> String {
    names
        .iter()
        .filter(|n| n.starts_with("KUBE-"))
        .map(|n| format!("flush {n}\ndestroy {n}\n"))
        .collect()
}

/// Sets kept in memory (tests): name -> entries, from the restore lines this module writes.
#[derive(Clone, Default)]
pub struct MemorySets(pub std::sync::Arc<std::sync::Mutex<BTreeMap<String, BTreeSet<String>>>>);

impl MemorySets {
    pub fn entries(&self, name: &str) -> Option<BTreeSet<String>> {
        self.0.lock().expect("not poisoned").get(name).cloned()
    }
}

impl IpSets for MemorySets {
    fn restore(&mut self, input: &str) -> Result<()> {
        let mut sets = self.0.lock().expect("not poisoned");
        let mut next = sets.clone();
        for line in input.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            let missing = |n: &str| anyhow::anyhow!("{line:?}: no set {n}");
            match words.as_slice() {
                ["create", name, ..] => {
                    next.entry(name.to_string()).or_default();
                }
                ["add", name, entry] => {
                    next.get_mut(*name)
                        .ok_or_else(|| missing(name))?
                        .insert(entry.to_string());
                }
                ["del", name, entry] => {
                    next.get_mut(*name)
                        .ok_or_else(|| missing(name))?
                        .remove(*entry);
                }
                ["flush", name] => next.get_mut(*name).ok_or_else(|| missing(name))?.clear(),
                ["swap", a, b] => {
                    let x = next.remove(*a).ok_or_else(|| missing(a))?;
                    let y = next.remove(*b).ok_or_else(|| missing(b))?;
                    next.insert(a.to_string(), y);
                    next.insert(b.to_string(), x);
                }
                ["destroy", name] => {
                    next.remove(*name).ok_or_else(|| missing(name))?;
                }
                _ => bail!("unexpected ipset restore line {line:?}"),
            }
        }
        *sets = next;
        Ok(())
    }

    fn names(&mut self) -> Result<Vec<String>> {
        Ok(self
            .0
            .lock()
            .expect("not poisoned")
            .keys()
            .cloned()
            .collect())
    }
}
