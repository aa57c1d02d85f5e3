//! Where the nftables proxier's commands go: the kernel (over netlink in the agent, see
//! [`super::netlink`]; through `nft -f -` in the tests that compare the two), or an
//! in-memory model of the commands it writes, for tests without a kernel.

use std::{collections::BTreeMap, process::Command};

use anyhow::{bail, Context, Result};

use crate::kernel::command;

/// An element of an address set (an affinity set's client), and the milliseconds it has
/// left if it expires.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Element {
    pub key: String,
    pub expires_ms: Option<u64>,
}

pub trait Nft {
    /// Runs `script` as one transaction: all of it or nothing.
    fn apply(&mut self, script: &str) -> Result<()>;

    /// Whether `family` (`ip` / `ip6`) has a table `table`, without listing what it holds
    /// (a listing of 100 000 services' chains takes minutes).
    fn has_table(&mut self, family: &str, table: &str) -> Result<bool>;

    /// The elements of address set `set`; empty if there is no such set.
    fn address_elements(&mut self, family: &str, table: &str, set: &str) -> Result<Vec<Element>>;
}

/// The `nft` command: what the agent's netlink transactions are compared with in tests.
#[derive(Clone, Debug, Default)]
pub struct NftCommand;

impl Nft for NftCommand {
    fn has_table(&mut self, family: &str, table: &str) -> Result<bool> {
        super::netlink::table_exists(family, table)
    }

    fn apply(&mut self, script: &str) -> Result<()> {
        let out = command::run(
            Command::new("nft").args(["-f", "-"]),
            Some(script.as_bytes()),
            command::RULESET_TIMEOUT,
        )
        .context("running nft (install the nftables package)")?;
        if !out.status.success() {
            // nft quotes the failing line itself (it names the service port's chain).
            let stderr = String::from_utf8_lossy(&out.stderr);
            let first: Vec<&str> = stderr.lines().take(3).collect();
            bail!("nft: {}", first.join(" | "));
        }
        Ok(())
    }

    fn address_elements(&mut self, family: &str, table: &str, set: &str) -> Result<Vec<Element>> {
        let out = command::run(
            Command::new("nft").args(["-j", "list", "set", family, table, set]),
            None,
            command::RULESET_TIMEOUT,
        )
        .context("running nft (install the nftables package)")?;
        if !out.status.success() {
            return Ok(Vec::new());
        }
        let json: serde_json::Value =
            serde_json::from_slice(&out.stdout).context("reading nft's JSON")?;
        Ok(json_elements(&json))
    }
}

/// The elements in `nft -j list set` output: `"10.0.0.9"`, or `{"elem": {"val":
/// "10.0.0.9", "expires": 4999}}` (seconds).
fn json_elements(json: &serde_json::Value) -> Vec<Element> {
    let sets = json["nftables"].as_array().into_iter().flatten();
    let elements = sets.flat_map(|o| o["set"]["elem"].as_array().into_iter().flatten());
    elements
        .filter_map(|e| {
            let (key, expires) = match e.as_str() {
                Some(key) => (key, None),
                None => (e["elem"]["val"].as_str()?, e["elem"]["expires"].as_u64()),
            };
            Some(Element {
                key: key.to_string(),
                expires_ms: expires.map(|s| s * 1000),
            })
        })
        .collect()
}

#[derive(Clone, Debug, Default)]
struct Table {
    chains: BTreeMap<String, Vec<String>>,
    /// Sets and maps: element key -> value ("" for sets).
    sets: BTreeMap<String, BTreeMap<String, String>>,
}

/// An in-memory model of the commands the proxier writes (`add table|chain|rule|set|map|
/// element`, `flush chain|set|map`, `delete table|chain|set|element`), as strict as the
/// kernel where it matters: rules only into existing chains, jumps and `@set`s only to
/// existing ones, no deleting a chain still jumped to, no deleting a missing element, a
/// transaction applies whole or not at all, and only if the netlink encoder can send it.
#[derive(Clone, Debug, Default)]
pub struct MemoryNft {
    tables: BTreeMap<(String, String), Table>,
    /// Every script applied, for tests to look at.
    pub scripts: Vec<String>,
}

impl MemoryNft {
    pub fn chain(&self, family: &str, table: &str, chain: &str) -> Option<Vec<String>> {
        self.tables
            .get(&(family.to_string(), table.to_string()))?
            .chains
            .get(chain)
            .cloned()
    }

    pub fn elements(
        &self,
        family: &str,
        table: &str,
        set: &str,
    ) -> Option<BTreeMap<String, String>> {
        self.tables
            .get(&(family.to_string(), table.to_string()))?
            .sets
            .get(set)
            .cloned()
    }

    pub fn has_table(&self, family: &str, table: &str) -> bool {
        self.tables
            .contains_key(&(family.to_string(), table.to_string()))
    }
}

/// The chains a rule or verdict jumps to.
fn targets(text: &str) -> Vec<String> {
    let words: Vec<&str> = text
        .split(|c: char| c.is_whitespace() || c == ',' || c == '}' || c == '{')
        .filter(|w| !w.is_empty())
        .collect();
    words
        .windows(2)
        .filter(|w| w[0] == "goto" || w[0] == "jump")
        .map(|w| w[1].to_string())
        .collect()
}

/// The sets a rule names (`@name`).
fn set_refs(text: &str) -> Vec<String> {
    text.split_whitespace()
        .filter_map(|w| w.strip_prefix('@'))
        .map(|w| w.trim_end_matches([',', '}']).to_string())
        .collect()
}

/// Splits `{ a, b }` into its elements.
fn elements(braced: &str) -> Vec<String> {
    let inner = braced
        .trim()
        .trim_start_matches('{')
        .trim_end_matches('}')
        .trim();
    if inner.is_empty() {
        return Vec::new();
    }
    inner.split(", ").map(|e| e.trim().to_string()).collect()
}

fn apply_command(tables: &mut BTreeMap<(String, String), Table>, line: &str) -> Result<()> {
    let words: Vec<&str> = line.splitn(5, ' ').collect();
    let (verb, kind) = (words.first().copied(), words.get(1).copied());
    let key = |i: usize| -> Result<(String, String)> {
        Ok((
            words.get(i).context("family")?.to_string(),
            words.get(i + 1).context("table")?.to_string(),
        ))
    };
    if kind == Some("table") {
        let k = key(2)?;
        match verb {
            Some("add") => {
                tables.entry(k).or_default();
            }
            Some("delete") => {
                tables.remove(&k).context("no such table")?;
            }
            _ => bail!("unexpected {line:?}"),
        }
        return Ok(());
    }
    let k = key(2)?;
    let rest = words.get(4).copied().unwrap_or_default();
    let (name, body) = rest.split_once(' ').unwrap_or((rest, ""));
    let table = tables.get_mut(&k).context("no such table")?;
    match (verb, kind) {
        (Some("add"), Some("chain")) => {
            table.chains.entry(name.to_string()).or_default();
        }
        (Some("flush"), Some("chain")) => {
            table.chains.get_mut(name).context("no such chain")?.clear();
        }
        (Some("delete"), Some("chain")) => {
            let used = table
                .chains
                .iter()
                .filter(|(c, _)| c.as_str() != name)
                .flat_map(|(_, rules)| rules.iter())
                .chain(table.sets.values().flat_map(|s| s.values()))
                .any(|r| targets(r).iter().any(|t| t == name));
            if used {
                bail!("chain {name} is still jumped to");
            }
            table.chains.remove(name).context("no such chain")?;
        }
        (Some("add"), Some("rule")) => {
            for t in targets(body) {
                if !table.chains.contains_key(&t) {
                    bail!("jump to missing chain {t}");
                }
            }
            for s in set_refs(body) {
                if !table.sets.contains_key(&s) {
                    bail!("no set {s}");
                }
            }
            table
                .chains
                .get_mut(name)
                .context("no such chain")?
                .push(body.to_string());
        }
        (Some("add"), Some("set" | "map")) => {
            table.sets.entry(name.to_string()).or_default();
        }
        (Some("flush"), Some("set" | "map")) => {
            table.sets.get_mut(name).context("no such set")?.clear();
        }
        (Some("delete"), Some("set" | "map")) => {
            let used = table
                .chains
                .values()
                .flatten()
                .any(|r| set_refs(r).iter().any(|s| s == name));
            if used {
                bail!("set {name} is still used");
            }
            table.sets.remove(name).context("no such set")?;
        }
        (Some("add"), Some("element")) => {
            for e in elements(body) {
                let (k, v) = e.split_once(" : ").unwrap_or((&e, ""));
                // A key's timeout and expiry are not modelled.
                let k = k.split(" timeout ").next().unwrap_or(k);
                let k = k.split(" expires ").next().unwrap_or(k);
                for t in targets(v) {
                    if !table.chains.contains_key(&t) {
                        bail!("verdict to missing chain {t}");
                    }
                }
                let set = table.sets.get_mut(name).context("no such set")?;
                match set.get(k) {
                    Some(old) if old != v => bail!("element {k} exists"),
                    _ => {
                        set.insert(k.to_string(), v.to_string());
                    }
                }
            }
        }
        (Some("delete"), Some("element")) => {
            let set = table.sets.get_mut(name).context("no such set")?;
            for e in elements(body) {
                set.remove(&e).with_context(|| format!("no element {e}"))?;
            }
        }
        _ => bail!("unexpected {line:?}"),
    }
    Ok(())
}

impl Nft for MemoryNft {
    fn apply(&mut self, script: &str) -> Result<()> {
        self.scripts.push(script.to_string());
        // What the agent could not send, the model refuses too.
        if let Err(super::netlink::Unsupported(line)) = super::netlink::encode_script(script) {
            bail!("no netlink encoding for {line:?}");
        }
        let mut tables = self.tables.clone();
        for (n, line) in script.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            apply_command(&mut tables, line).with_context(|| format!("line {}: {line}", n + 1))?;
        }
        self.tables = tables;
        Ok(())
    }

    fn has_table(&mut self, family: &str, table: &str) -> Result<bool> {
        Ok(MemoryNft::has_table(self, family, table))
    }

    fn address_elements(&mut self, family: &str, table: &str, set: &str) -> Result<Vec<Element>> {
        let elements = self.elements(family, table, set).unwrap_or_default();
        Ok(elements
            .into_keys()
            .map(|key| Element {
                key,
                expires_ms: None,
            })
            .collect())
    }
}
