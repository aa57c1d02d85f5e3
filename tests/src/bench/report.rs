//! What the mode comparison measured, as raw samples, and the Markdown table made from
//! them: medians with min–max over the rounds, and ratios to the no-proxy baseline at the
//! same service count.

use std::{collections::BTreeMap, fmt::Write as _};

use serde::{Deserialize, Serialize};

use super::load::median_min_max;

/// The target every ratio is taken against: the client straight to a backend pod.
pub const BASELINE: &str = "none";

/// What one data-plane sample measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Workload {
    /// Connect-request-close, new connections per second.
    ConnectionsPerSecond,
    /// Connect time of those connections, median, microseconds.
    ConnectP50Us,
    /// Connect time, 99th percentile, microseconds.
    ConnectP99Us,
    /// Request/response transactions per second on one connection.
    TransactionsPerSecond,
    /// Bulk TCP, bytes per second received by the sink.
    BulkBytesPerSecond,
    /// Connect-request-close from [`Run::clients`] threads at once, connections per second.
    SaturatedConnectionsPerSecond,
    /// The machine's busy CPU time during that workload per connection, microseconds.
    CpuUsPerConnection,
    /// Its kernel share (system, interrupts, softirq: where a datapath runs), microseconds.
    KernelCpuUsPerConnection,
    /// How busy the machine's cores were during it, percent (near 100: saturated).
    BusyPercent,
    /// Request/response on [`Run::clients`] connections at once, transactions per second.
    SaturatedTransactionsPerSecond,
}

impl Workload {
    pub const ALL: [Workload; 10] = [
        Workload::ConnectionsPerSecond,
        Workload::ConnectP50Us,
        Workload::ConnectP99Us,
        Workload::TransactionsPerSecond,
        Workload::BulkBytesPerSecond,
        Workload::SaturatedConnectionsPerSecond,
        Workload::CpuUsPerConnection,
        Workload::KernelCpuUsPerConnection,
        Workload::BusyPercent,
        Workload::SaturatedTransactionsPerSecond,
    ];
}

/// One measurement of one workload through one target in one round.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Services programmed (the measured one included).
    pub services: usize,
    /// A proxy mode, or [`BASELINE`].
    pub target: String,
    pub round: usize,
    pub workload: Workload,
    pub value: f64,
    /// How many operations the value is made of (connections, transactions, bytes).
    pub operations: u64,
}

/// A mode's control plane at one service count.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ControlSample {
    pub services: usize,
    pub mode: String,
    /// From starting the agent until the measured ClusterIP served a connection.
    pub cold_start_ms: Option<f64>,
    /// From writing the manifests with one more endpoint until a connection reached it.
    pub one_change_ms: Option<f64>,
    /// The agent's own sync of that change (its `kubeproxy_sync_proxy_rules_duration_seconds`),
    /// without the manifest source's reading of the whole file and its settle window.
    #[serde(default)]
    pub one_change_sync_ms: Option<f64>,
    /// From starting the agent again on the state its predecessor left until its first
    /// sync was recorded (the datapath serves throughout).
    #[serde(default)]
    pub restart_ms: Option<f64>,
    /// The agent's peak resident set (VmHWM), KiB.
    pub peak_rss_kib: Option<u64>,
    /// What the mode programmed, by its own metric: (metric, value).
    pub datapath_objects: Option<(String, f64)>,
    /// Why a figure is missing.
    pub note: Option<String>,
}

/// Everything one run measured.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Run {
    pub command: String,
    pub date: String,
    pub kernel: String,
    pub cpus: usize,
    /// Where it ran: `host`, or the VM runner's kernel.
    pub environment: String,
    pub rounds: usize,
    pub seconds_per_workload: f64,
    /// Client threads of the saturated workloads.
    #[serde(default)]
    pub clients: usize,
    pub samples: Vec<Sample>,
    pub control: Vec<ControlSample>,
    /// The control plane fed by the replayed API server instead of manifests.
    #[serde(default)]
    pub api: Vec<ControlSample>,
    /// Modes not run, with the reason.
    pub skipped: Vec<(String, String)>,
    pub duration_s: f64,
}

impl Run {
    /// Values of one (services, target, workload) across rounds.
    pub fn values(&self, services: usize, target: &str, workload: Workload) -> Vec<f64> {
        self.samples
            .iter()
            .filter(|s| s.services == services && s.target == target && s.workload == workload)
            .map(|s| s.value)
            .collect()
    }

    /// The targets measured, baseline first, then in the order they were run.
    pub fn targets(&self) -> Vec<String> {
        let mut out: Vec<String> = vec![BASELINE.to_string()];
        for s in &self.samples {
            if !out.contains(&s.target) {
                out.push(s.target.clone());
            }
        }
        for c in &self.control {
            if !out.contains(&c.mode) {
                out.push(c.mode.clone());
            }
        }
        out
    }

    pub fn service_counts(&self) -> Vec<usize> {
        let mut n: Vec<usize> = self
            .samples
            .iter()
            .map(|s| s.services)
            .chain(self.control.iter().map(|c| c.services))
            .collect();
        n.sort_unstable();
        n.dedup();
        n
    }

    pub fn control(&self, services: usize, mode: &str) -> Option<&ControlSample> {
        self.control
            .iter()
            .find(|c| c.services == services && c.mode == mode)
    }
}

fn figure(value: f64, digits: usize) -> String {
    if value.is_nan() {
        return "—".into();
    }
    if value >= 1000.0 {
        // Thousands separated by thin spaces, as the README's tables.
        let s = format!("{value:.0}");
        let mut out = String::new();
        for (i, c) in s.chars().enumerate() {
            if i > 0 && (s.len() - i) % 3 == 0 {
                out.push(' ');
            }
            out.push(c);
        }
        out
    } else {
        format!("{value:.digits$}")
    }
}

/// `median (min–max)` and the ratio of the median to the baseline's, scaled by `scale`.
fn cell(values: &[f64], baseline: &[f64], scale: f64, digits: usize, ratio: bool) -> String {
    if values.is_empty() {
        return "—".into();
    }
    let (med, min, max) = median_min_max(values);
    let mut out = format!(
        "{} ({}–{})",
        figure(med * scale, digits),
        figure(min * scale, digits),
        figure(max * scale, digits)
    );
    if ratio && !baseline.is_empty() {
        let (base, _, _) = median_min_max(baseline);
        if base > 0.0 {
            let _ = write!(out, " ×{:.2}", med / base);
        }
    }
    out
}

/// How a target is named in tables and plots.
pub fn label(target: &str) -> &str {
    if target == BASELINE {
        "none (straight to a pod)"
    } else {
        target
    }
}

/// The [`cell`] of `workload` for `target` at `n` services (its ratio to the baseline's
/// when `ratio`).
fn column(
    run: &Run,
    n: usize,
    target: &str,
    workload: Workload,
    scale: f64,
    digits: usize,
    ratio: bool,
) -> String {
    cell(
        &run.values(n, target, workload),
        &run.values(n, BASELINE, workload),
        scale,
        digits,
        ratio,
    )
}

/// A control record's cells: cold start, one change, its sync, restart (ms), peak RSS (MiB),
/// programmed.
fn control_figures(control: Option<&ControlSample>) -> [String; 6] {
    let ms = |x: Option<f64>| {
        x.map_or("—".to_string(), |x| {
            figure(x, if x < 1.0 { 3 } else { 1 })
        })
    };
    [
        ms(control.and_then(|c| c.cold_start_ms)),
        ms(control.and_then(|c| c.one_change_ms)),
        ms(control.and_then(|c| c.one_change_sync_ms)),
        ms(control.and_then(|c| c.restart_ms)),
        control
            .and_then(|c| c.peak_rss_kib)
            .map_or("—".to_string(), |k| format!("{:.1}", k as f64 / 1024.0)),
        control
            .and_then(|c| c.datapath_objects.clone())
            .map_or("—".to_string(), |(m, v)| {
                format!("{} `{m}`", figure(v, 0))
            }),
    ]
}

/// The Markdown table: one row per mode × service count (baseline rows included).
pub fn markdown(run: &Run) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} · kernel {} · {} CPUs · {} · {} round(s) × {:.1} s per workload · run took {:.0} s\n",
        run.environment,
        run.kernel,
        run.cpus,
        run.date,
        run.rounds,
        run.seconds_per_workload,
        run.duration_s
    );
    let _ = writeln!(out, "`{}`\n", run.command);
    out.push_str(
        "| mode | services | new connections/s | transactions/s | bulk MB/s | connect p50 µs | connect p99 µs | cold start ms | one change ms | its sync ms | restart ms | peak RSS MiB | programmed |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for n in run.service_counts() {
        for target in run.targets() {
            let control = run.control(n, &target);
            if run
                .values(n, &target, Workload::ConnectionsPerSecond)
                .is_empty()
                && control.is_none()
            {
                continue;
            }
            let [cold, change, sync, restart, rss, objects] = control_figures(control);
            let col = |w, scale, digits, ratio| column(run, n, &target, w, scale, digits, ratio);
            let mut row = format!(
                "| {} | {n} | {} | {} | {} | {} | {} | {cold} | {change} | {sync} | {restart} | {rss} | {objects} |",
                label(&target),
                col(Workload::ConnectionsPerSecond, 1.0, 0, true),
                col(Workload::TransactionsPerSecond, 1.0, 0, true),
                col(Workload::BulkBytesPerSecond, 1e-6, 0, true),
                col(Workload::ConnectP50Us, 1.0, 0, false),
                col(Workload::ConnectP99Us, 1.0, 0, false),
            );
            if let Some(note) = control.and_then(|c| c.note.as_deref()) {
                let _ = write!(row, " {note}");
            }
            out.push_str(&row);
            out.push('\n');
        }
    }
    out.push_str(
        "\nCold start: agent started until the ClusterIP serves and the agent has recorded its first sync \
         (nftables and iptables-nft write large datapaths in several transactions, serving some services first). One change: manifests written with one more \
         endpoint until a connection reaches it (the manifest source re-reads the file, parses the documents \
         that changed, and lets writes settle for `--manifests-settle`, 100 ms, first); its sync: the agent's own \
         sync of that change (its histogram; a datapath may serve before the sync returns). Restart: the agent \
         stopped and started again on what it left (pinned maps and programs, rules) until its first sync is \
         recorded; the datapath serves throughout.\n",
    );
    saturated_table(run, &mut out);
    if !run.api.is_empty() {
        out.push_str(
            "\nThrough the API-server source (a replayed API server in the node namespace: paged lists, then a watch; \
             one change: an EndpointSlice MODIFIED event with one more endpoint, until a connection reaches it):\n\n\
             | mode | services | cold start ms | one change ms | its sync ms | peak RSS MiB | programmed |\n\
             |---|---|---|---|---|---|---|\n",
        );
        for c in &run.api {
            let f = control_figures(Some(c));
            let _ = write!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} |",
                c.mode, c.services, f[0], f[1], f[2], f[4], f[5]
            );
            if let Some(note) = &c.note {
                let _ = write!(out, " {note}");
            }
            out.push('\n');
        }
    }
    if !run.skipped.is_empty() {
        out.push_str("\nNot run here:\n");
        for (mode, why) in &run.skipped {
            let _ = writeln!(out, "- {mode}: {why}");
        }
    }
    out
}

/// The saturated workloads' table: throughput with every core busy, and the machine's CPU
/// time per connection (client, backends and datapath together: the baseline's figure is
/// what the rest costs, a mode's excess over it is its datapath's).
fn saturated_table(run: &Run, out: &mut String) {
    if !run
        .samples
        .iter()
        .any(|s| s.workload == Workload::SaturatedConnectionsPerSecond)
    {
        return;
    }
    let _ = write!(
        out,
        "\nUnder saturation ({} client threads on {} CPUs; CPU time is the whole machine's, per connection):\n\n\
         | mode | services | new connections/s | transactions/s | CPU µs per connection | of it kernel µs | cores busy % |\n\
         |---|---|---|---|---|---|---|\n",
        run.clients, run.cpus
    );
    for n in run.service_counts() {
        for target in run.targets() {
            if run
                .values(n, &target, Workload::SaturatedConnectionsPerSecond)
                .is_empty()
            {
                continue;
            }
            let col = |w, scale, digits, ratio| column(run, n, &target, w, scale, digits, ratio);
            let _ = writeln!(
                out,
                "| {} | {n} | {} | {} | {} | {} | {} |",
                label(&target),
                col(Workload::SaturatedConnectionsPerSecond, 1.0, 0, true),
                col(Workload::SaturatedTransactionsPerSecond, 1.0, 0, true),
                col(Workload::CpuUsPerConnection, 1.0, 1, true),
                col(Workload::KernelCpuUsPerConnection, 1.0, 1, true),
                col(Workload::BusyPercent, 1.0, 0, false),
            );
        }
    }
}

/// Checks a run against what every report must satisfy: each data-plane figure comes from
/// measured operations, every mode at every count has its control-plane record, the
/// baseline was measured at every count. Returns the problems found.
pub fn problems(run: &Run) -> Vec<String> {
    let mut out = Vec::new();
    for s in &run.samples {
        if !s.value.is_finite() || s.value <= 0.0 || s.operations == 0 {
            out.push(format!(
                "{} at {} services, round {}: {:?} = {} from {} operations",
                s.target, s.services, s.round, s.workload, s.value, s.operations
            ));
        }
    }
    let workloads: std::collections::BTreeSet<Workload> =
        run.samples.iter().map(|s| s.workload).collect();
    let mut per_target: BTreeMap<(usize, &str), usize> = BTreeMap::new();
    for s in &run.samples {
        *per_target.entry((s.services, &s.target)).or_default() += 1;
    }
    for n in run.service_counts() {
        if !per_target.contains_key(&(n, BASELINE)) {
            out.push(format!("no baseline at {n} services"));
        }
    }
    for ((n, target), count) in &per_target {
        // Runs recorded before a workload existed have none of it: count those present.
        let want = run.rounds * workloads.len();
        // A mode that failed a workload has the reason in its note, in the table.
        let explained = run.control(*n, target).is_some_and(|c| c.note.is_some());
        if *count != want && !explained {
            out.push(format!(
                "{target} at {n} services: {count} samples, {want} expected"
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run() -> Run {
        let mut r = Run {
            rounds: 2,
            ..Default::default()
        };
        for (target, scale) in [(BASELINE, 1.0), ("ebpf", 0.5)] {
            for round in 0..2 {
                for w in Workload::ALL {
                    r.samples.push(Sample {
                        services: 10,
                        target: target.into(),
                        round,
                        workload: w,
                        value: 1000.0 * scale * (round + 1) as f64,
                        operations: 5,
                    });
                }
            }
        }
        r.control.push(ControlSample {
            services: 10,
            mode: "ebpf".into(),
            cold_start_ms: Some(12.5),
            ..Default::default()
        });
        r
    }

    #[test]
    fn rows_carry_medians_ranges_and_ratios_to_the_baseline() {
        let table = markdown(&run());
        let ebpf = table
            .lines()
            .find(|l| l.starts_with("| ebpf | 10 |"))
            .unwrap();
        // Rounds 500 and 1000: median 750, half the baseline's (1500).
        assert!(ebpf.contains("| 750 (500–1 000) ×0.50 |"), "{ebpf}");
        assert!(ebpf.contains("| 12.5 |"), "{ebpf}");
        assert!(table.contains("| none (straight to a pod) | 10 |"));
        assert!(problems(&run()).is_empty());
    }

    #[test]
    fn placeholders_and_missing_rounds_are_problems() {
        let mut r = run();
        r.samples[0].operations = 0;
        r.samples.pop();
        let p = problems(&r);
        assert_eq!(p.len(), 2, "{p:?}");
    }

    #[test]
    fn a_mode_missing_rounds_is_complete_only_with_the_reason_in_its_note() {
        let mut r = run();
        r.samples.retain(|s| !(s.target == "ebpf" && s.round == 1));
        assert_eq!(problems(&r).len(), 1);
        r.control[0].note = Some("round 2: connecting to 10.96.0.10:80: timed out".into());
        assert!(problems(&r).is_empty());
        assert!(markdown(&r).contains("round 2: connecting"));
    }
}
