//! Where the iptables proxier's rules go: the kernel through `iptables-restore` /
//! `ip6tables-restore` (whichever backend, nft or legacy, the host's `iptables` is), or an
//! in-memory model of `--noflush` restores for tests without a kernel.

use std::{collections::BTreeMap, process::Command};

use anyhow::{bail, Context, Result};

use crate::{kernel::command, model::IpFamily};

/// Tables that take `iptables-restore` input.
pub trait RuleTables {
    /// Applies `input` as `iptables-restore --noflush` does: declared chains are flushed
    /// (created if missing), `-A`/`-I` add rules, `-X` deletes chains; one table per
    /// `*table` … `COMMIT` block, each applied whole or not at all.
    fn restore(&mut self, family: IpFamily, input: &str) -> Result<()>;

    /// The table as `iptables-save -t <table>` prints it.
    fn save(&mut self, family: IpFamily, table: &str) -> Result<String>;

    /// Whether a full sync should write the service chains in several restores:
    /// `iptables-nft-restore` (1.8.9) finds each rule's chain by a linear search through
    /// the chains its input declared, so one input of N services costs N²: more than 7
    /// minutes at 10 000. The legacy backend rewrites the whole table per restore, so for
    /// it one input is cheaper.
    fn chunked_full_syncs(&mut self) -> bool {
        false
    }
}

/// The host's iptables commands (`iptables-restore`, `ip6tables-save`, …).
#[derive(Clone, Debug)]
pub struct IptablesCommands {
    /// "" for the host's default (`iptables`), or "-nft" / "-legacy".
    pub variant: String,
    /// Whether the commands are the nf_tables backend (asked once).
    nft_backend: Option<bool>,
}

impl IptablesCommands {
    pub fn host_default() -> Self {
        Self::variant("")
    }

    /// `variant`: "", "-nft" or "-legacy".
    pub fn variant(variant: &str) -> Self {
        IptablesCommands {
            variant: variant.to_string(),
            nft_backend: None,
        }
    }

    /// Whether `iptables` is the nf_tables backend (`iptables v1.8.9 (nf_tables)`).
    fn is_nft(&mut self) -> bool {
        *self
            .nft_backend
            .get_or_insert_with(|| match self.variant.as_str() {
                "-nft" => true,
                "-legacy" => false,
                _ => command::run(
                    Command::new("iptables").arg("--version"),
                    None,
                    command::PROBE_TIMEOUT,
                )
                .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains("nf_tables")),
            })
    }

    fn binary(&self, family: IpFamily, what: &str) -> String {
        let base = match family {
            IpFamily::V4 => "iptables",
            IpFamily::V6 => "ip6tables",
        };
        format!("{base}{}-{what}", self.variant)
    }

    /// Whether the commands run at all (the binaries exist and the kernel has the tables).
    pub fn probe(&self, family: IpFamily) -> Result<()> {
        let bin = self.binary(family, "save");
        let out = command::run(
            Command::new(&bin).args(["-t", "nat"]),
            None,
            command::PROBE_TIMEOUT,
        )
        .with_context(|| format!("running {bin} (install the iptables package)"))?;
        if !out.status.success() {
            bail!(
                "{bin} -t nat failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }
}

impl RuleTables for IptablesCommands {
    fn restore(&mut self, family: IpFamily, input: &str) -> Result<()> {
        let bin = self.binary(family, "restore");
        let out = command::run(
            Command::new(&bin).args(["-w", "5", "--noflush"]),
            Some(input.as_bytes()),
            command::RULESET_TIMEOUT,
        )
        .with_context(|| format!("running {bin} (install the iptables package)"))?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
            // "line N failed": quote the line, which names the service in its comment.
            let line = stderr
                .split("line ")
                .nth(1)
                .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
                .and_then(|n| n.parse::<usize>().ok())
                .and_then(|n| input.lines().nth(n.saturating_sub(1)));
            match line {
                Some(l) => bail!("{bin}: {stderr} ({l})"),
                None => bail!("{bin}: {stderr}"),
            }
        }
        Ok(())
    }

    fn save(&mut self, family: IpFamily, table: &str) -> Result<String> {
        let bin = self.binary(family, "save");
        let out = command::run(
            Command::new(&bin).args(["-t", table]),
            None,
            command::RULESET_TIMEOUT,
        )
        .with_context(|| format!("running {bin} (install the iptables package)"))?;
        if !out.status.success() {
            bail!(
                "{bin} -t {table}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn chunked_full_syncs(&mut self) -> bool {
        self.is_nft()
    }
}

/// Built-in chains of each table, as the kernel has them.
fn builtin_chains(table: &str) -> &'static [&'static str] {
    match table {
        "nat" => &["PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"],
        "filter" => &["INPUT", "FORWARD", "OUTPUT"],
        "mangle" => &["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"],
        _ => &[],
    }
}

const TARGETS: &[&str] = &[
    "ACCEPT",
    "DROP",
    "RETURN",
    "REJECT",
    "DNAT",
    "SNAT",
    "MARK",
    "MASQUERADE",
];

type Table = BTreeMap<String, Vec<String>>;

/// An in-memory model of `iptables-restore --noflush`, strict where the kernel is: rules
/// may only be added to existing chains, jump only to existing chains or known targets,
/// and a chain still jumped to cannot be deleted.
#[derive(Clone, Debug, Default)]
pub struct MemoryTables {
    tables: BTreeMap<(IpFamily, String), Table>,
    /// Every restore input, for tests to look at.
    pub restores: Vec<(IpFamily, String)>,
    /// Answer for [`RuleTables::chunked_full_syncs`] (as the nf_tables backend would).
    pub chunked: bool,
}

impl MemoryTables {
    fn table(&self, family: IpFamily, name: &str) -> Table {
        self.tables
            .get(&(family, name.to_string()))
            .cloned()
            .unwrap_or_else(|| {
                builtin_chains(name)
                    .iter()
                    .map(|c| (c.to_string(), Vec::new()))
                    .collect()
            })
    }

    /// The rules of one chain (`-A` lines without the `-A CHAIN` prefix).
    pub fn chain(&self, family: IpFamily, table: &str, chain: &str) -> Option<Vec<String>> {
        self.tables
            .get(&(family, table.to_string()))?
            .get(chain)
            .cloned()
    }

    pub fn chains(&self, family: IpFamily, table: &str) -> Vec<String> {
        self.table(family, table).keys().cloned().collect()
    }
}

fn apply_line(table: &mut Table, line: &str) -> Result<()> {
    if let Some(decl) = line.strip_prefix(':') {
        let chain = decl.split(' ').next().unwrap_or_default();
        table.insert(chain.to_string(), Vec::new());
        return Ok(());
    }
    let mut words = line.splitn(3, ' ');
    let (op, chain) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let rest = words.next().unwrap_or("");
    match op {
        "-A" | "-I" => {
            let rule = if op == "-I" {
                rest.split_once(' ').map_or(rest, |(_, r)| r)
            } else {
                rest
            };
            if let Some(target) = rule.split(" -j ").nth(1) {
                let target = target.split(' ').next().unwrap_or_default();
                if !TARGETS.contains(&target) && !table.contains_key(target) {
                    bail!("jump to missing chain {target}: {line}");
                }
            }
            let rules = table
                .get_mut(chain)
                .with_context(|| format!("no chain {chain}: {line}"))?;
            if op == "-I" {
                rules.insert(0, rule.to_string());
            } else {
                rules.push(rule.to_string());
            }
        }
        "-D" => {
            let rules = table
                .get_mut(chain)
                .with_context(|| format!("no chain {chain}: {line}"))?;
            let at = rules
                .iter()
                .position(|r| r == rest)
                .with_context(|| format!("no such rule: {line}"))?;
            rules.remove(at);
        }
        "-X" => {
            let jump = format!("-j {chain}");
            if table
                .values()
                .flatten()
                .any(|r| r.ends_with(&jump) || r.contains(&format!("{jump} ")))
            {
                bail!("chain {chain} is still jumped to: {line}");
            }
            if table.remove(chain).is_none() {
                bail!("no chain {chain} to delete");
            }
        }
        _ => bail!("unexpected line {line:?}"),
    }
    Ok(())
}

impl RuleTables for MemoryTables {
    fn chunked_full_syncs(&mut self) -> bool {
        self.chunked
    }

    fn restore(&mut self, family: IpFamily, input: &str) -> Result<()> {
        self.restores.push((family, input.to_string()));
        let mut current: Option<(String, Table)> = None;
        for (n, line) in input.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if let Some(name) = line.strip_prefix('*') {
                current = Some((name.to_string(), self.table(family, name)));
            } else if line == "COMMIT" {
                let (name, table) = current.take().context("COMMIT outside a table")?;
                self.tables.insert((family, name), table);
            } else {
                let (_, table) = current.as_mut().context("rule outside a table")?;
                apply_line(table, line).with_context(|| format!("line {} failed", n + 1))?;
            }
        }
        Ok(())
    }

    fn save(&mut self, family: IpFamily, table: &str) -> Result<String> {
        let t = self.table(family, table);
        let mut out = format!("*{table}\n");
        for chain in t.keys() {
            out.push_str(&format!(":{chain} - [0:0]\n"));
        }
        for (chain, rules) in &t {
            for r in rules {
                out.push_str(&format!("-A {chain} {r}\n"));
            }
        }
        out.push_str("COMMIT\n");
        Ok(out)
    }
}
