//! `cargo xtask demo`: the agent on the demo manifests, in a lab of network namespaces,
//! serving real TCP and UDP from a client pod, and where the traffic went.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddrV4},
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use clap::Parser;
use proxy_tests::{
    kernel::kernel_tests_unavailable,
    lab::{client, Lab, LabOptions},
};

const CONNECTIONS: usize = 150;

/// The agent on deploy/demo/demo.yaml in a lab of network namespaces (needs root): TCP and
/// UDP from a client pod through its services, where the traffic went, a service without a
/// ready endpoint, serving on with the agent stopped, and --cleanup. It takes no flags.
#[derive(Debug, Parser)]
#[command(name = "demo")]
struct Args {}

fn spread(results: Vec<std::io::Result<String>>) -> String {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for r in &results {
        let key = match r {
            Ok(pod) => pod.clone(),
            Err(e) => format!("error: {e}"),
        };
        *counts.entry(key).or_default() += 1;
    }
    counts
        .iter()
        .map(|(k, n)| format!("{k} {n} ({:.0}%)", 100.0 * *n as f64 / results.len() as f64))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Runs `proxy-agent inspect ARGS` in the lab's node, as an operator would on a node, and
/// prints what it said.
fn inspect(lab: &Lab, args: &[&str]) -> Result<()> {
    let bin = proxy_tests::lab::agent_binary()?;
    let root = lab.bpffs.root();
    let mut all = vec!["inspect"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--bpffs-root", root.to_str().context("bpffs path")?]);
    let out = lab.node.exec(bin.to_str().context("agent path")?, &all)?;
    println!("$ proxy-agent inspect {}", args.join(" "));
    for line in out.lines() {
        println!("  {line}");
    }
    Ok(())
}

/// `proxy-agent inspect flows --follow --count N` in the lab's node while `traffic` runs:
/// the new flows it printed as the datapath decided them.
fn follow_flows(lab: &Lab, count: usize, traffic: impl FnOnce() -> Result<()>) -> Result<()> {
    use std::io::BufRead;
    let bin = proxy_tests::lab::agent_binary()?;
    let root = lab.bpffs.root();
    let n = count.to_string();
    let args = ["inspect", "flows", "--follow", "--count", &n];
    let mut child = std::process::Command::new("ip")
        .args(["netns", "exec", &lab.node.name])
        .arg(&bin)
        .args(args)
        .args(["--bpffs-root", root.to_str().context("bpffs path")?])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    // It prints this line once it listens: traffic before it would not be shown.
    let mut said = String::new();
    std::io::BufReader::new(child.stderr.take().context("stderr")?).read_line(&mut said)?;
    traffic()?;
    let out = child.wait_with_output()?;
    println!("$ proxy-agent {}", args.join(" "));
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        println!("  {line}");
    }
    Ok(())
}

fn main() -> Result<()> {
    let Args {} = Args::parse();
    if let Some(reason) = kernel_tests_unavailable() {
        bail!("the demo needs the kernel datapath: {reason}");
    }
    let manifests = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/demo/demo.yaml");
    let manifests = manifests.canonicalize().context("deploy/demo/demo.yaml")?;

    println!("lab: node namespace, client pod 10.244.0.2, backend pods 10.244.1.11-13 (TCP 8080, UDP 5353)");
    let mut lab = Lab::new(LabOptions::default())?;
    println!("     namespaces {}-*", lab.id);
    println!(
        "agent: proxy-agent --manifests {} --interfaces 'lxc*'",
        manifests.display()
    );
    lab.start_agent(&manifests, &[])?;
    let log = lab.agent().unwrap().log_text();
    for line in log
        .lines()
        .filter(|l| l.contains("Using") || l.contains("attached") || l.contains("synced"))
    {
        println!(
            "     | {}",
            line.split_once("Z ").map(|x| x.1).unwrap_or(line).trim()
        );
    }

    let web = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 10), 80);
    let tcp = lab.client.ns.run(move || {
        (0..CONNECTIONS)
            .map(|_| client::tcp_hello(web, Duration::from_secs(2)))
            .collect::<Vec<_>>()
    })?;
    println!(
        "TCP {web} (demo/web), {CONNECTIONS} connections: {}",
        spread(tcp)
    );

    let dns = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 53), 53);
    let udp = lab.client.ns.run(move || {
        (0..CONNECTIONS)
            .map(|_| client::udp_hello(dns, Duration::from_secs(2)))
            .collect::<Vec<_>>()
    })?;
    println!(
        "UDP {dns} (demo/dns), {CONNECTIONS} queries: {}",
        spread(udp)
    );

    let dead = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 99), 80);
    let (took, result) = lab.client.ns.run(move || {
        let started = Instant::now();
        let r = client::tcp_hello(dead, Duration::from_secs(2));
        (started.elapsed(), r)
    })?;
    match result {
        Err(e) => println!(
            "TCP {dead} (demo/not-ready, no ready endpoint): {e} after {:.1} ms",
            took.as_secs_f64() * 1000.0
        ),
        Ok(pod) => println!("TCP {dead}: unexpectedly answered by {pod}"),
    }
    // What an operator asks the agent on the node (kubectl exec ... proxy-agent inspect).
    inspect(&lab, &["services", "demo/web"])?;
    inspect(&lab, &["explain", "demo/not-ready"])?;
    // New flows as the datapath decides them, while someone follows.
    follow_flows(&lab, 3, || {
        lab.client.ns.run(move || {
            let _ = client::tcp_hello(web, Duration::from_secs(2));
            let _ = client::tcp_hello(web, Duration::from_secs(2));
            let _ = client::tcp_hello(dead, Duration::from_secs(2));
        })
    })?;
    lab.stop_agent()?;
    println!(
        "agent stopped (SIGTERM): the pinned datapath keeps serving, as kube-proxy's rules do"
    );
    let after_stop = lab.client.ns.run(move || {
        (0..30)
            .map(|_| client::tcp_hello(web, Duration::from_secs(2)))
            .collect::<Vec<_>>()
    })?;
    println!(
        "TCP {web} with no agent running, 30 connections: {}",
        spread(after_stop)
    );
    // With no agent to ask, inspect reads the pinned maps, which kept counting.
    inspect(&lab, &["services", "demo/web"])?;
    let (ok, out) = lab.run_agent_once(&["--cleanup"])?;
    if !ok {
        bail!("proxy-agent --cleanup failed: {out}");
    }
    println!("proxy-agent --cleanup: links, filters, pins and maps removed");
    println!("cleaning up the lab");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn takes_no_arguments() {
        Args::command().debug_assert();
        assert!(Args::try_parse_from(["demo"]).is_ok());
        assert!(Args::try_parse_from(["demo", "--bogus"]).is_err());
        assert!(Args::try_parse_from(["demo", "stray"]).is_err());
    }
}
