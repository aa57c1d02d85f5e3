//! `inspect`'s table output: columns aligned as `ipvsadm -Ln` aligns them, for people
//! (`-o json` is for programs). Golden files in `golden/` hold what each renders.

use std::fmt::Write;

use super::{
    conntrack::FlowsView,
    services::{PortView, ServicesView, Traffic},
    trace::TraceView,
};
use crate::model::explain::{Explanation, PortExplanation};

/// Rows as columns padded to their widest cell, two spaces apart; each line indented by
/// `indent`, the last column not padded.
fn aligned(indent: &str, rows: &[Vec<String>]) -> String {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|cell| cell.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in rows {
        let mut line = indent.to_string();
        for (c, cell) in row.iter().enumerate() {
            if c + 1 == row.len() {
                line.push_str(cell);
            } else {
                let _ = write!(line, "{cell:<width$}  ", width = widths[c]);
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

fn yes(b: bool) -> String {
    if b { "yes" } else { "no" }.into()
}

/// `inspect explain`'s table.
pub fn explanation(e: &Explanation) -> String {
    let mut out = format!(
        "Service {} on node {}{}\n",
        e.service,
        e.node,
        e.zone
            .as_deref()
            .map(|z| format!(" (zone {z})"))
            .unwrap_or_default()
    );
    if let Some(note) = &e.note {
        let _ = writeln!(out, "  {note}");
    }
    if !e.problems.is_empty() {
        out.push_str("  problems:\n");
        for p in &e.problems {
            let _ = writeln!(out, "    {p}");
        }
    }
    for port in &e.ports {
        out.push('\n');
        port_table(&mut out, port);
    }
    out
}

fn port_table(out: &mut String, p: &PortExplanation) {
    let name = if p.port.is_empty() {
        "(unnamed)".to_string()
    } else {
        p.port.clone()
    };
    let _ = writeln!(
        out,
        "Port {name} {} {}: {}",
        p.protocol,
        p.family,
        match &p.not_served {
            None => "served".to_string(),
            Some(why) => format!("not served: {why}"),
        }
    );
    let mut rows = vec![vec![
        "FRONTEND".to_string(),
        "KIND".into(),
        "FIELD".into(),
        "SERVED".into(),
        "REASON".into(),
    ]];
    rows.extend(p.frontends.iter().map(|f| {
        vec![
            f.frontend.clone(),
            f.kind.clone(),
            f.field.clone(),
            yes(f.served),
            f.reason.clone().unwrap_or_default(),
        ]
    }));
    out.push_str(&aligned("  ", &rows));
    if !p.served {
        return;
    }
    let _ = writeln!(
        out,
        "  internalTrafficPolicy {}, externalTrafficPolicy {}, scheduler {}, affinity {}",
        p.internal_traffic_policy,
        p.external_traffic_policy,
        p.scheduler,
        p.affinity_timeout_seconds
            .map(|t| format!("ClientIP {t}s"))
            .unwrap_or_else(|| "none".into())
    );
    let _ = writeln!(out, "  topology: {}", p.topology);
    for t in &p.when_empty {
        let _ = writeln!(
            out,
            "  {} traffic without endpoints: {}",
            t.traffic, t.outcome
        );
    }
    if p.endpoints.is_empty() {
        out.push_str("  no endpoints in the Service's EndpointSlices\n");
        return;
    }
    let mut rows = vec![vec![
        "ENDPOINT".to_string(),
        "NODE".into(),
        "ZONE".into(),
        "CONDITIONS".into(),
        "TRAFFIC".into(),
        "STATE".into(),
        "REASON".into(),
    ]];
    for ep in &p.endpoints {
        let conditions: Vec<&str> = [
            (ep.ready, "ready"),
            (ep.serving, "serving"),
            (ep.terminating, "terminating"),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, name)| *name)
        .collect();
        let node = match (&ep.node, ep.local) {
            (Some(n), true) => format!("{n} (this)"),
            (Some(n), false) => n.clone(),
            (None, _) => "-".into(),
        };
        for (i, u) in ep.uses.iter().enumerate() {
            let first = i == 0;
            rows.push(vec![
                if first {
                    ep.address.to_string()
                } else {
                    String::new()
                },
                if first { node.clone() } else { String::new() },
                if first {
                    ep.zone.clone().unwrap_or_else(|| "-".into())
                } else {
                    String::new()
                },
                if first {
                    if conditions.is_empty() {
                        "none".into()
                    } else {
                        conditions.join(",")
                    }
                } else {
                    String::new()
                },
                u.traffic.clone(),
                u.state.clone(),
                u.reason.clone(),
            ]);
        }
    }
    out.push_str(&aligned("  ", &rows));
}

fn counter(n: Option<u64>) -> String {
    n.map_or_else(|| "-".into(), |n| n.to_string())
}

fn traffic_cells(t: &Traffic) -> [String; 3] {
    [counter(t.connections), counter(t.packets), counter(t.bytes)]
}

/// The first lines of a listing: the node, the mode, how many `noun`s (and how many are
/// listed, when not all), and where they come from.
fn heading(
    (node, mode): (&str, &str),
    (total, listed, noun): (usize, usize, &str),
    truncated_hint: &str,
    (label, source): (&str, &str),
) -> String {
    format!(
        "node {node}, mode {mode}: {total} {noun}{}{}\n{label}: {source}\n",
        if total == 1 { "" } else { "s" },
        if listed < total {
            format!(" (the first {listed} listed{truncated_hint})")
        } else {
            String::new()
        },
    )
}

/// `inspect services`' table: per service port, its frontends and its backends, each with
/// its counters (`-`: the mode does not count that).
pub fn services(v: &ServicesView) -> String {
    let mut out = heading(
        (&v.node, &v.mode),
        (v.total_ports, v.ports.len(), "service port"),
        ": name a Service for the others",
        ("counters", &v.counters),
    );
    for p in &v.ports {
        out.push('\n');
        service_port(&mut out, p);
    }
    out
}

fn service_port(out: &mut String, p: &PortView) {
    let port = if p.port.is_empty() {
        String::new()
    } else {
        format!(" port {}", p.port)
    };
    let _ = writeln!(
        out,
        "{}{port} {} {}, scheduler {}, affinity {}",
        p.service,
        p.protocol,
        p.family,
        p.scheduler,
        p.affinity_timeout_seconds
            .map(|t| format!("ClientIP {t}s"))
            .unwrap_or_else(|| "none".into())
    );
    let mut rows = vec![[
        "FRONTEND",
        "KIND",
        "BACKENDS",
        "CONNECTIONS",
        "PACKETS",
        "BYTES",
    ]
    .map(String::from)
    .to_vec()];
    for f in &p.frontends {
        let backends = match &f.when_empty {
            Some(outcome) => format!("none: {outcome}"),
            None => f.serving.len().to_string(),
        };
        let mut row = vec![f.frontend.clone(), f.kind.clone(), backends];
        row.extend(traffic_cells(&f.traffic));
        rows.push(row);
    }
    out.push_str(&aligned("  ", &rows));
    if p.backends.is_empty() {
        return;
    }
    let mut rows = vec![[
        "BACKEND",
        "WEIGHT",
        "STATE",
        "LOCAL",
        "CONNECTIONS",
        "PACKETS",
        "BYTES",
    ]
    .map(String::from)
    .to_vec()];
    for b in &p.backends {
        let mut row = vec![
            b.address.to_string(),
            b.weight.map_or_else(|| "-".into(), |w| w.to_string()),
            b.state.clone(),
            yes(b.local),
        ];
        row.extend(traffic_cells(&b.traffic));
        rows.push(row);
    }
    out.push_str(&aligned("  ", &rows));
}

/// `inspect conntrack`'s table: a flow a line.
pub fn flows(v: &FlowsView) -> String {
    let mut out = heading(
        (&v.node, &v.mode),
        (v.total, v.flows.len(), "flow"),
        "",
        ("from", &v.source),
    );
    if v.flows.is_empty() {
        return out;
    }
    let mut rows = vec![[
        "PROTO", "CLIENT", "FRONTEND", "BACKEND", "SERVICE", "STATE", "IDLE", "EXPIRES",
    ]
    .map(String::from)
    .to_vec()];
    for f in &v.flows {
        rows.push(vec![
            f.protocol.clone(),
            f.client.to_string(),
            f.frontend.to_string(),
            f.backend.to_string(),
            f.service.clone().unwrap_or_else(|| "-".into()),
            f.state.clone(),
            f.idle_seconds
                .map_or_else(|| "-".into(), |s| format!("{s}s")),
            f.expires_in_seconds
                .map_or_else(|| "-".into(), |s| format!("{s}s")),
        ]);
    }
    out.push_str(&aligned("", &rows));
    out
}

/// `inspect trace`'s answer: the verdict, then each step.
pub fn trace(v: &TraceView) -> String {
    let mut out = format!(
        "node {}, mode {}: {} -> {}\n{}\n",
        v.node, v.mode, v.client, v.destination, v.verdict
    );
    let mut rows: Vec<Vec<String>> = v
        .steps
        .iter()
        .map(|s| vec![s.step.clone(), s.outcome.clone()])
        .collect();
    if !v.candidates.is_empty() {
        let list: Vec<String> = v.candidates.iter().map(|c| c.to_string()).collect();
        rows.push(vec!["candidates".into(), list.join(" ")]);
    }
    if let Some(r) = &v.remembered {
        rows.push(vec![
            "affinity".into(),
            format!("{} ({} s left)", r.backend, r.valid_for_seconds),
        ]);
    }
    for f in &v.existing {
        rows.push(vec![
            "tracked flow".into(),
            format!("{} -> {} ({})", f.client, f.backend, f.state),
        ]);
    }
    if !v.decided_by.is_empty() {
        rows.push(vec!["decided by".into(), v.decided_by.clone()]);
    }
    out.push_str(&aligned("  ", &rows));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align_to_the_widest_cell_and_the_last_is_not_padded() {
        let rows = vec![
            vec!["A".to_string(), "BB".into(), "C".into()],
            vec!["long".to_string(), "".into(), "x".into()],
        ];
        assert_eq!(aligned("  ", &rows), "  A     BB  C\n  long      x\n");
    }

    /// The table of the golden explanation (written by the model's own golden test).
    #[test]
    fn the_explain_table_is_the_golden_one() {
        let json = include_str!("golden/explain.json");
        let e: Explanation = serde_json::from_str(json).unwrap();
        crate::inspect::assert_golden("explain.txt", &explanation(&e));
    }

    #[test]
    fn the_conntrack_table_is_the_golden_one() {
        let json = include_str!("golden/conntrack.json");
        let v: FlowsView = serde_json::from_str(json).unwrap();
        crate::inspect::assert_golden("conntrack.txt", &flows(&v));
    }

    #[test]
    fn the_trace_is_the_golden_one() {
        let json = include_str!("golden/trace.json");
        let v: TraceView = serde_json::from_str(json).unwrap();
        crate::inspect::assert_golden("trace.txt", &trace(&v));
    }

    #[test]
    fn the_services_table_is_the_golden_one() {
        let json = include_str!("golden/services.json");
        let v: ServicesView = serde_json::from_str(json).unwrap();
        crate::inspect::assert_golden("services.txt", &services(&v));
    }
}
