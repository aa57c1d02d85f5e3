//! New TCP connections per second from a pod in the two-node lab, the eBPF mode as the
//! DaemonSet runs it (socket hooks on the node's cgroup): through a ClusterIP with the pod's
//! process below the hooks (translated at connect time), through the same ClusterIP from
//! outside the hooked cgroup (translated per packet at tc), and straight to the backend pod.
//! Each connection: connect, read the backend's one-line greeting, close. The targets are
//! measured in alternating rounds so drift affects all alike; the backend is on the
//! client's node, so no target crosses the link between nodes.

use std::{
    net::{SocketAddr, SocketAddrV4},
    path::Path,
};

use anyhow::{bail, Context, Result};
use clap::Parser;
use proxy_tests::{
    cluster::{Cluster, CLIENT},
    kernel::kernel_tests_unavailable,
};

/// New TCP connections per second from a pod: ClusterIP through the socket hooks, the same
/// ClusterIP through the tc path, and the backend pod directly, in 4 alternating rounds;
/// prints a Markdown table.
#[derive(Debug, Parser)]
#[command(name = "connbench")]
struct Args {
    /// Connections per target and round.
    #[arg(value_name = "PER_ROUND", default_value_t = 1000)]
    per_round: usize,
}

#[derive(Default)]
struct Series {
    connect_us: Vec<f64>,
    seconds: f64,
    connections: usize,
}

impl Series {
    fn add(&mut self, other: Series) {
        self.connect_us.extend(other.connect_us);
        self.seconds += other.seconds;
        self.connections += other.connections;
    }
}

/// A round in a process in the pod's network namespace (`podclient bench`): in the pod's
/// cgroup, below the socket hooks, or (`below_hooks` false) in this process's cgroup,
/// outside them. Every series runs in a process of its own, alike.
fn pod_round(
    c: &Cluster,
    podclient: &Path,
    below_hooks: bool,
    to: SocketAddr,
    n: usize,
) -> Result<Series> {
    let mut command = if below_hooks {
        c.pod_command(CLIENT, podclient)
    } else {
        let mut command = std::process::Command::new(podclient);
        command.args(["--netns", &c.pod(CLIENT).ns.name]);
        command
    };
    let out = command
        .args(["bench", &to.to_string(), &n.to_string()])
        .output()
        .context("running podclient")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut s = Series::default();
    for line in text.lines() {
        if let Some(total) = line.strip_prefix("TOTAL ") {
            s.seconds = total.parse()?;
        } else {
            s.connect_us
                .push(line.parse().with_context(|| format!("podclient: {line}"))?);
            s.connections += 1;
        }
    }
    if s.connections != n {
        bail!(
            "podclient made {} of {n} connections: {text}",
            s.connections
        );
    }
    Ok(s)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn main() -> Result<()> {
    let per_round = Args::parse().per_round;
    if let Some(reason) = kernel_tests_unavailable() {
        bail!("cannot benchmark: {reason}");
    }
    let podclient = std::env::current_exe()?.with_file_name("podclient");
    if !podclient.is_file() {
        bail!(
            "{} not found: build it (cargo build --release -p proxy-tests --bins)",
            podclient.display()
        );
    }
    let rounds = 4;
    let mut c = Cluster::new()?;
    let backend = c.pod("web-1a").ip;
    let vip: SocketAddr = "10.96.0.10:80".parse()?;
    let manifests = c.write_manifests(&format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: lab}}\nspec:\n  clusterIP: 10.96.0.10\n  ports:\n  - {{name: http, protocol: TCP, port: 80, targetPort: 8080}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: web-1, namespace: lab, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\nports:\n- {{name: http, protocol: TCP, port: 8080}}\nendpoints:\n- addresses: [\"{backend}\"]\n  nodeName: node-1\n---\n"
    ))?;
    c.start_agents(&manifests, &[])?;
    let direct: SocketAddr = SocketAddrV4::new(backend, 8080).into();

    let mut hooks = Series::default();
    let mut tc = Series::default();
    let mut pod = Series::default();
    // Warm up every path (neighbours, caches).
    pod_round(&c, &podclient, true, vip, 50)?;
    pod_round(&c, &podclient, false, vip, 50)?;
    pod_round(&c, &podclient, false, direct, 50)?;
    for _ in 0..rounds {
        hooks.add(pod_round(&c, &podclient, true, vip, per_round)?);
        tc.add(pod_round(&c, &podclient, false, vip, per_round)?);
        pod.add(pod_round(&c, &podclient, false, direct, per_round)?);
    }

    println!(
        "TCP connect + greeting + close from a pod, sequential, {} connections per target in {rounds} alternating rounds",
        per_round * rounds
    );
    println!("| target | connections/s | connect p50 µs | connect p99 µs |");
    println!("|---|---:|---:|---:|");
    let mut rates = Vec::new();
    for (name, mut s) in [
        (
            format!("ClusterIP {vip}, socket hooks (pod below them)"),
            hooks,
        ),
        (format!("ClusterIP {vip}, tc path (pod outside them)"), tc),
        (format!("pod {direct} directly"), pod),
    ] {
        s.connect_us.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let rate = s.connections as f64 / s.seconds;
        rates.push(rate);
        println!(
            "| {name} | {rate:.0} | {:.1} | {:.1} |",
            percentile(&s.connect_us, 0.5),
            percentile(&s.connect_us, 0.99)
        );
    }
    println!(
        "hooks / direct: {:.2}; tc / direct: {:.2}; hooks / tc: {:.2}",
        rates[0] / rates[2],
        rates[1] / rates[2],
        rates[0] / rates[1]
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn connections_per_round_is_the_one_positional() {
        Args::command().debug_assert();
        let parse = |args: &[&str]| {
            Args::try_parse_from(std::iter::once("connbench").chain(args.iter().copied()))
        };
        assert_eq!(parse(&[]).unwrap().per_round, 1000);
        assert_eq!(parse(&["2000"]).unwrap().per_round, 2000);
        for bad in [&["x"][..], &["10", "20"], &["--bogus"]] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }
}
