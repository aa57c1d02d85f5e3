//! The agent's life cycle on a node: restart and upgrade without dropping connections,
//! explicit handling of a map-layout change, `--cleanup`, missing privileges.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use aya::{
    maps::{Array, Map, MapData, MapInfo},
    programs::links::{FdLink, PinnedLink},
};
use proxy_common::{map_names, DatapathConfig};
use proxy_tests::{
    lab::{agent_binary, manifest::service, ConnectLoop, Lab, LabOptions, Session, TCP_PORT},
    require_kernel,
};

const WEB: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 10), 80);

fn manifest(lab: &Lab) -> String {
    let ips: Vec<Ipv4Addr> = lab.backends.iter().map(|p| p.ip).collect();
    service("web", *WEB.ip(), &[("http", "TCP", 80, TCP_PORT)], &ips)
}

fn started_lab(extra: &[&str]) -> (Lab, PathBuf) {
    let mut lab = Lab::new(LabOptions::default()).expect("lab");
    let path = lab.write_manifests(&manifest(&lab)).unwrap();
    lab.start_agent(&path, extra).expect("agent");
    (lab, path)
}

/// Says why a test does not run here: straight to stderr, past the harness's capture, so
/// the VM runner counts it as skipped with its reason rather than passed.
fn skip(what: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIP {what}");
}

fn upgrade_object() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../proxy-ebpf/target/upgrade-test-variant/bpfel-unknown-none/release/proxy-ebpf")
}

/// The TCX link pinned for `lxc0`.
fn tcx_link_on_lxc0(lab: &Lab) -> aya::programs::links::LinkInfo {
    let links = lab.bpffs.root().join("links");
    let pin = std::fs::read_dir(&links)
        .unwrap()
        .flatten()
        .find(|e| e.file_name().to_string_lossy().starts_with("lxc0@"))
        .unwrap_or_else(|| panic!("no link pinned for lxc0 in {}", links.display()))
        .path();
    let link = FdLink::from(PinnedLink::from_pin(pin).unwrap());
    link.info().unwrap()
}

/// Id of the program on `lxc0`'s ingress: behind its pinned TCX link, or, on kernels
/// without TCX (before 6.6), in its netlink filter.
fn program_on_lxc0(lab: &Lab) -> u32 {
    let links = lab.bpffs.root().join("links");
    let tcx = std::fs::read_dir(&links)
        .map(|d| {
            d.flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("lxc0@"))
        })
        .unwrap_or(false);
    if tcx {
        return tcx_link_on_lxc0(lab).program_id();
    }
    let filters = lab
        .node
        .exec("tc", &["filter", "show", "dev", "lxc0", "ingress"])
        .unwrap();
    filters
        .split_whitespace()
        .skip_while(|w| *w != "id")
        .nth(1)
        .and_then(|id| id.parse().ok())
        .unwrap_or_else(|| panic!("no program on lxc0: {filters}"))
}

/// Stops the agent and starts another while a connection stays open and a client keeps
/// opening new ones; returns the new agent's log.
fn replace_agent_under_load(lab: &mut Lab, manifests: &Path, extra: &[&str]) -> String {
    let session = Session::open(&lab.client.ns, WEB).unwrap();
    assert_eq!(session.exchange("before").unwrap(), "before");
    let connects = ConnectLoop::start(&lab.client.ns, WEB);
    std::thread::sleep(Duration::from_millis(300));
    lab.stop_agent().unwrap();
    // No agent at all for a while: the pinned datapath serves alone.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(session.exchange("between").unwrap(), "between");
    lab.start_agent(manifests, extra).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let (ok, failed) = connects.finish().unwrap();
    assert!(
        failed.is_empty(),
        "{} of {} new connections failed: {:?}",
        failed.len(),
        ok + failed.len(),
        &failed[..failed.len().min(5)]
    );
    assert!(ok > 20, "the client loop made only {ok} connections");
    assert_eq!(
        session.exchange("after").unwrap(),
        "after",
        "the open connection broke"
    );
    lab.agent().unwrap().log_text()
}

#[test]
fn restart_keeps_open_connections_and_new_ones_working() {
    require_kernel!();
    let (mut lab, manifests) = started_lab(&[]);
    let before = program_on_lxc0(&lab);
    let log = replace_agent_under_load(&mut lab, &manifests, &[]);
    assert!(log.contains("adopting the pinned datapath"), "{log}");
    assert!(
        log.contains("took over the pinned service maps frontends=1"),
        "{log}"
    );
    assert!(
        log.contains("how=Replaced"),
        "the new agent must reuse the attachments: {log}"
    );
    // The same build on the same maps: the verified programs are taken over, not loaded
    // again (the verifier is most of a start).
    assert!(log.contains(REUSED), "{log}");
    assert_eq!(
        program_on_lxc0(&lab),
        before,
        "the pinned program keeps running"
    );
}

/// An agent run with `--ebpf-ipv6=false` (the operator's choice, or a kernel whose verifier
/// refuses the IPv6 programs): their absence is part of what is reused.
#[test]
fn a_restart_without_the_ipv6_datapath_reuses_the_ipv4_programs() {
    require_kernel!();
    let (mut lab, manifests) = started_lab(&["--ebpf-ipv6=false"]);
    let before = program_on_lxc0(&lab);
    let log = replace_agent_under_load(&mut lab, &manifests, &["--ebpf-ipv6=false"]);
    assert!(log.contains(REUSED), "{log}");
    assert_eq!(program_on_lxc0(&lab), before);
    if std::env::var("PROXY_AGENT_ARGS").is_ok_and(|a| a.contains("--ebpf-ipv6=false")) {
        eprintln!("SKIP wanting IPv6 again: every agent here runs with --ebpf-ipv6=false (PROXY_AGENT_ARGS)");
        return;
    }
    // Wanting IPv6 again is another build: verified, with its IPv6 programs.
    let log = replace_agent_under_load(&mut lab, &manifests, &[]);
    assert!(log.contains(VERIFIED) && !log.contains(REUSED), "{log}");
    assert!(!log.contains("IPv6 datapath is not loaded"), "{log}");
}

/// The capabilities `deploy/daemonset.yaml` adds (lower case, as setpriv names them).
fn daemonset_capabilities() -> Vec<String> {
    let yaml = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/daemonset.yaml"),
    )
    .unwrap();
    let mut caps = Vec::new();
    let mut in_add = false;
    for line in yaml.lines().map(str::trim) {
        if line == "add:" {
            in_add = true;
        } else if in_add && line.starts_with("- ") {
            caps.push(line[2..].trim().to_lowercase());
        } else if in_add && !line.starts_with('#') {
            in_add = false;
        }
    }
    caps
}

/// Whether this process may hand `cap` on (it is in its bounding set).
fn in_bounding_set(cap: &str) -> bool {
    Command::new("setpriv")
        .args([
            &format!("--inh-caps=-all,+{cap}"),
            &format!("--ambient-caps=-all,+{cap}"),
            "true",
        ])
        .status()
        .is_ok_and(|s| s.success())
}

/// The eBPF agent as the DaemonSet runs it: root without `CAP_SYS_ADMIN`, only the
/// capabilities the manifest adds. Restarts too, reusing its programs (nothing opened by id,
/// which needs `CAP_SYS_ADMIN`).
#[test]
fn the_ebpf_agent_runs_and_restarts_with_only_the_daemonsets_capabilities() {
    require_kernel!();
    let mut caps = daemonset_capabilities();
    assert!(caps.contains(&"bpf".to_string()), "{caps:?}");
    caps.retain(|cap| {
        let ok = in_bounding_set(cap);
        if !ok {
            // This sandbox's own bounding set lacks it (SYS_RESOURCE: only kernels before
            // 5.11 need it, for RLIMIT_MEMLOCK).
            eprintln!("not granted here (this process cannot): {cap}");
        }
        ok
    });
    let set = format!(
        "-all,{}",
        caps.iter()
            .map(|c| format!("+{c}"))
            .collect::<Vec<_>>()
            .join(",")
    );
    let mut lab = Lab::new(LabOptions::default()).expect("lab");
    lab.agent_prefix = [
        "setpriv",
        &format!("--bounding-set={set}"),
        &format!("--inh-caps={set}"),
        &format!("--ambient-caps={set}"),
        "--",
    ]
    .map(String::from)
    .to_vec();
    let manifests = lab.write_manifests(&manifest(&lab)).unwrap();
    lab.start_agent(&manifests, &[])
        .expect("agent with the DaemonSet's capabilities");
    let answer = lab
        .client
        .ns
        .run(|| proxy_tests::lab::client::tcp_hello(WEB, Duration::from_secs(2)))
        .unwrap();
    assert!(answer.unwrap().starts_with("pod"), "served");
    let log = replace_agent_under_load(&mut lab, &manifests, &[]);
    assert!(log.contains(REUSED), "{log}");
}

const REUSED: &str = "datapath programs reused from the pins of this build";
const VERIFIED: &str = "datapath programs loaded and verified";

#[test]
fn a_restart_with_other_datapath_settings_verifies_its_own_programs() {
    require_kernel!();
    // Backend counters are compiled in or out of the programs when they load.
    let (mut lab, manifests) = started_lab(&[]);
    let before = program_on_lxc0(&lab);
    let log = replace_agent_under_load(&mut lab, &manifests, &["--backend-metrics"]);
    assert!(log.contains(VERIFIED) && !log.contains(REUSED), "{log}");
    let with_counters = program_on_lxc0(&lab);
    assert_ne!(with_counters, before, "the new settings' program runs");
    // Back to the first settings: their programs went when the second build pinned its own.
    lab.stop_agent().unwrap();
    lab.start_agent(&manifests, &["--backend-metrics"]).unwrap();
    let log = lab.agent().unwrap().log_text();
    assert!(log.contains(REUSED), "{log}");
    assert_eq!(program_on_lxc0(&lab), with_counters);
}

#[test]
fn upgrade_to_a_different_program_keeps_connections() {
    require_kernel!();
    if proxy_tests::kernel::kernel_version() < (5, 17) {
        // The agent loads its no-bpf-loop build there, of which no variant is built.
        skip("upgrade_to_a_different_program_keeps_connections: the upgrade variant is a bpf_loop build (5.17+)");
        return;
    }
    let variant = upgrade_object();
    assert!(
        variant.exists(),
        "{} missing: run `cargo xtask build-ebpf`",
        variant.display()
    );
    let (mut lab, manifests) = started_lab(&[]);
    let variant = variant.to_str().unwrap().to_string();
    let before = program_on_lxc0(&lab);
    let log = replace_agent_under_load(&mut lab, &manifests, &["--ebpf-object", &variant]);
    assert!(log.contains("how=Replaced"), "{log}");
    assert!(log.contains(VERIFIED) && !log.contains(REUSED), "{log}");
    let upgraded = program_on_lxc0(&lab);
    assert_ne!(upgraded, before, "the upgrade's program runs");
    // And back again, the way a rollback would go.
    let log = replace_agent_under_load(&mut lab, &manifests, &[]);
    assert!(log.contains("how=Replaced"), "{log}");
    assert!(log.contains(VERIFIED) && !log.contains(REUSED), "{log}");
    assert_ne!(program_on_lxc0(&lab), upgraded);
}

#[test]
fn netlink_attachments_are_replaced_in_place_on_restart() {
    require_kernel!();
    let (mut lab, manifests) = started_lab(&["--tc-attach", "netlink"]);
    let log = replace_agent_under_load(&mut lab, &manifests, &["--tc-attach", "netlink"]);
    assert!(log.contains("how=Replaced"), "{log}");
    let filters = lab
        .node
        .exec("tc", &["filter", "show", "dev", "lxc0", "ingress"])
        .unwrap();
    assert_eq!(
        filters.lines().filter(|l| l.contains(" handle ")).count(),
        1,
        "exactly one filter after the restart: {filters}"
    );
}

/// Pins of a build from before `SERVICE_NAMES` (the map absent): the next agent adopts them
/// all the same, adds the map, and names every frontend, so `inspect services` reads the
/// pins by name once it stops.
#[test]
fn pins_without_service_names_are_adopted_and_their_frontends_named() {
    require_kernel!();
    let (mut lab, manifests) = started_lab(&[]);
    lab.stop_agent().unwrap();
    let names = lab.bpffs.root().join("maps").join(map_names::SERVICE_NAMES);
    std::fs::remove_file(&names).unwrap();
    lab.start_agent(&manifests, &[]).unwrap();
    let log = lab.agent().unwrap().log_text();
    assert!(log.contains("adopting the pinned datapath"), "{log}");
    assert!(names.exists(), "SERVICE_NAMES pinned again");
    lab.stop_agent().unwrap();
    let root = lab.bpffs.root();
    let json = lab
        .node
        .exec(
            agent_binary().unwrap().to_str().unwrap(),
            &[
                "inspect",
                "services",
                "--pinned",
                "--bpffs-root",
                root.to_str().unwrap(),
                "-o",
                "json",
            ],
        )
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let port = &v["ports"][0];
    assert!(
        port["service"].as_str().unwrap().ends_with("/web"),
        "{json}"
    );
    assert_eq!(port["port"], "http", "{json}");
    assert_eq!(
        port["frontends"][0]["frontend"],
        format!("{WEB}/TCP"),
        "{json}"
    );
    assert_eq!(port["frontends"][0]["kind"], "ClusterIP", "{json}");
    assert_eq!(
        port["backends"].as_array().unwrap().len(),
        lab.backends.len(),
        "{json}"
    );
}

#[test]
fn a_map_layout_change_is_detected_and_the_maps_rebuilt() {
    require_kernel!();
    let (mut lab, manifests) = started_lab(&[]);
    lab.stop_agent().unwrap();
    // Pretend the pinned maps were written by an agent with another layout.
    let pin = lab.bpffs.root().join("maps").join(map_names::CONFIG);
    let mut config: Array<MapData, DatapathConfig> =
        Array::try_from(Map::Array(MapData::from_pin(&pin).unwrap())).unwrap();
    let mut value = config.get(&0, 0).unwrap();
    let old_id = MapInfo::from_pin(&pin).unwrap().id();
    value.layout_version = 999;
    config.set(0, value, 0).unwrap();
    drop(config);

    lab.start_agent(&manifests, &[]).unwrap();
    let log = lab.agent().unwrap().log_text();
    assert!(
        log.contains(&format!(
            "rebuilding the datapath maps: the pinned maps have layout version 999; this agent uses {}",
            proxy_common::MAP_LAYOUT_VERSION
        )),
        "{log}"
    );
    assert_ne!(
        MapInfo::from_pin(&pin).unwrap().id(),
        old_id,
        "new maps were created"
    );
    // The pinned programs use the old maps: verified again for the new ones.
    assert!(log.contains(VERIFIED) && !log.contains(REUSED), "{log}");
    let answer = lab
        .client
        .ns
        .run(|| proxy_tests::lab::client::tcp_hello(WEB, Duration::from_secs(2)))
        .unwrap();
    assert!(
        answer.unwrap().starts_with("pod"),
        "served after the rebuild"
    );
}

/// Asks bpftool whether the kernel still has the object `kind` (`prog`, `map`, `link`) `id`.
fn bpftool_has(kind: &str, id: u32) -> bool {
    Command::new("bpftool")
        .args([kind, "show", "id", &id.to_string()])
        .output()
        .expect("bpftool")
        .status
        .success()
}

fn program_exists(id: u32) -> bool {
    bpftool_has("prog", id)
}

fn map_exists(id: u32) -> bool {
    bpftool_has("map", id)
}

/// Objects are freed after an RCU grace period: wait for them to go.
fn eventually_gone(what: &str, exists: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while exists() {
        assert!(
            Instant::now() < deadline,
            "{what} still exists 5 s after --cleanup"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn cleanup_removes_everything(mode: &str) {
    let (mut lab, _) = started_lab(&["--tc-attach", mode]);
    let root = lab.bpffs.root();
    let map_ids: Vec<u32> = std::fs::read_dir(root.join("maps"))
        .unwrap()
        .flatten()
        .map(|e| MapInfo::from_pin(e.path()).unwrap().id())
        .collect();
    assert_eq!(map_ids.len(), 34, "every map of the datapath is pinned");
    let link_id = (mode == "tcx").then(|| tcx_link_on_lxc0(&lab).id());
    let prog_id = program_on_lxc0(&lab);
    lab.stop_agent().unwrap();
    assert!(
        program_exists(prog_id),
        "the stopped agent's program keeps serving"
    );

    for run in 0..2 {
        let (ok, out) = lab.run_agent_once(&["--cleanup"]).unwrap();
        assert!(ok, "--cleanup run {run} failed: {out}");
    }
    for dev in ["lxc0", "lxc1", "lxc2", "lxc3"] {
        let filters = lab
            .node
            .exec("tc", &["filter", "show", "dev", dev, "ingress"])
            .unwrap();
        assert!(filters.trim().is_empty(), "{dev}: {filters}");
        let qdiscs = lab.node.exec("tc", &["qdisc", "show", "dev", dev]).unwrap();
        assert!(
            !qdiscs.contains("clsact"),
            "{dev}: the clsact qdisc we added stays: {qdiscs}"
        );
    }
    assert!(!root.exists(), "{} still exists", root.display());
    if let Some(id) = link_id {
        eventually_gone("the TCX link", || bpftool_has("link", id));
    }
    eventually_gone("the program", || program_exists(prog_id));
    for id in map_ids {
        eventually_gone("a map", || map_exists(id));
    }
}

#[test]
fn cleanup_removes_everything_tcx_installed_and_is_idempotent() {
    require_kernel!();
    if proxy_tests::kernel::kernel_version() < (6, 6) {
        skip("cleanup_removes_everything_tcx_installed_and_is_idempotent: TCX needs kernel 6.6 (the netlink row runs here)");
        return;
    }
    cleanup_removes_everything("tcx");
}

#[test]
fn cleanup_removes_everything_netlink_installed_and_is_idempotent() {
    require_kernel!();
    cleanup_removes_everything("netlink");
}

#[test]
fn missing_privileges_get_a_one_line_explanation() {
    require_kernel!();
    let out = Command::new("setpriv")
        .args([
            "--bounding-set=-all",
            "--inh-caps=-all",
            "--ambient-caps=-all",
            "--",
        ])
        .arg(agent_binary().unwrap())
        .args(["--manifests", "/nonexistent"])
        .env("NO_COLOR", "1")
        .output()
        .expect("setpriv (util-linux)");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line, no backtrace: {stderr}");
    assert!(
        lines[0].starts_with(
            "error: missing CAP_BPF, CAP_PERFMON and CAP_NET_ADMIN: run proxy-agent as root, or grant them"
        ),
        "{stderr}"
    );
}

#[test]
fn the_netfilter_modes_need_only_cap_net_admin() {
    require_kernel!();
    // In a namespace of its own (the agent must not get as far as the node's tables, but
    // nothing runs in the root namespace either way).
    let ns = proxy_tests::lab::Netns::create(&format!(
        "{}-{}-{}-caps",
        proxy_tests::lab::PREFIX,
        std::process::id(),
        proxy_tests::lab::LAB_COUNTER.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
    ))
    .unwrap();
    for (mode, expect_missing) in [
        ("iptables", None),
        ("nftables", None),
        ("ebpf", Some("error: missing CAP_BPF and CAP_PERFMON: ")),
    ] {
        let out = Command::new("ip")
            .args(["netns", "exec", &ns.name, "setpriv"])
            .args([
                "--bounding-set=-all,+net_admin",
                "--inh-caps=-all,+net_admin",
                "--ambient-caps=-all,+net_admin",
                "--",
            ])
            .arg(agent_binary().unwrap())
            .args(["--proxy-mode", mode, "--manifests", "/nonexistent"])
            // The runner's flags (on 5.10: nftables' kernel-check skip), so the agent gets
            // as far as a real node's would.
            .args(
                std::env::var("PROXY_AGENT_ARGS")
                    .unwrap_or_default()
                    .split_whitespace(),
            )
            .env("NO_COLOR", "1")
            .output()
            .expect("setpriv (util-linux)");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{mode}: {stderr}");
        match expect_missing {
            Some(line) => assert!(stderr.contains(line), "{mode}: {stderr}"),
            // Past the capability check: it stops at the missing manifests instead.
            None => {
                assert!(!stderr.contains("missing CAP"), "{mode}: {stderr}");
                assert!(stderr.contains("/nonexistent"), "{mode}: {stderr}");
            }
        }
    }
}

/// Every kube-proxy-style rule in the node's iptables (both families, every table).
fn kube_rules(lab: &Lab) -> Vec<String> {
    let mut rules = Vec::new();
    for save in ["iptables-save", "ip6tables-save"] {
        let out = lab.node.exec(save, &[]).unwrap();
        rules.extend(
            out.lines()
                .filter(|l| l.contains("KUBE-"))
                .map(|l| format!("{save}: {l}")),
        );
    }
    rules
}

/// What the eBPF mode leaves on the node: tc filters on the pod links, the bpffs root.
fn ebpf_leftovers(lab: &Lab) -> Vec<String> {
    let mut left = Vec::new();
    for dev in ["lxc0", "lxc1", "lxc2", "lxc3"] {
        for hook in ["ingress", "egress"] {
            let filters = lab
                .node
                .exec("tc", &["filter", "show", "dev", dev, hook])
                .unwrap();
            if !filters.trim().is_empty() {
                left.push(format!("{dev} {hook}: {filters}"));
            }
        }
    }
    let root = lab.bpffs.root();
    if root.exists() {
        left.push(format!("{} exists", root.display()));
    }
    left
}

/// What upstream kube-proxy's iptables mode leaves on a node (abridged from a real
/// `iptables-save`).
const UPSTREAM_KUBE_PROXY: &str = "*mangle
:KUBE-PROXY-CANARY - [0:0]
COMMIT
*filter
:KUBE-PROXY-CANARY - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-IPVS-FILTER - [0:0]
:KUBE-IPVS-OUT-FILTER - [0:0]
:KUBE-NODE-PORT - [0:0]
:KUBE-SOURCE-RANGES-FIREWALL - [0:0]
-A INPUT -m comment --comment \"kubernetes ipvs access filter\" -j KUBE-IPVS-FILTER
-A OUTPUT -m comment --comment \"kubernetes ipvs access filter\" -j KUBE-IPVS-OUT-FILTER
-A INPUT -m comment --comment \"kubernetes health check rules\" -j KUBE-NODE-PORT
-A KUBE-PROXY-FIREWALL -j KUBE-SOURCE-RANGES-FIREWALL
-A KUBE-SOURCE-RANGES-FIREWALL -j DROP
-A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL
-A INPUT -m comment --comment \"kubernetes health check service ports\" -j KUBE-NODEPORTS
-A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES
-A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD
-A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
COMMIT
*nat
:KUBE-MARK-MASQ - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-NODE-PORT - [0:0]
:KUBE-LOAD-BALANCER - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-SEP-IOZ5JIQNHTTBQCVZ - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-NPX46M4PTMTKRN6Y - [0:0]
-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0
-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully
-A KUBE-SEP-IOZ5JIQNHTTBQCVZ -s 10.88.0.2/32 -m comment --comment \"default/kubernetes:https\" -j KUBE-MARK-MASQ
-A KUBE-SEP-IOZ5JIQNHTTBQCVZ -p tcp -m comment --comment \"default/kubernetes:https\" -m tcp -j DNAT --to-destination 10.88.0.2:6443
-A KUBE-SERVICES -d 10.96.0.1/32 -p tcp -m comment --comment \"default/kubernetes:https cluster IP\" -m tcp --dport 443 -j KUBE-SVC-NPX46M4PTMTKRN6Y
-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-NODE-PORT -j RETURN
-A KUBE-SVC-NPX46M4PTMTKRN6Y -m comment --comment \"default/kubernetes:https -> 10.88.0.2:6443\" -j KUBE-SEP-IOZ5JIQNHTTBQCVZ
COMMIT
";

/// Whether the node has a `kube-proxy` nftables table (this agent's nftables mode or
/// kube-proxy's), in either family.
fn nft_tables(lab: &Lab) -> Vec<String> {
    let out = lab.node.exec("nft", &["list", "tables"]).unwrap();
    out.lines()
        .filter(|l| l.contains("kube-proxy"))
        .map(String::from)
        .collect()
}

/// What `mode` leaves on the node, if anything.
fn leftovers(lab: &Lab, mode: &str) -> Vec<String> {
    match mode {
        "ebpf" => ebpf_leftovers(lab),
        "iptables" => kube_rules(lab),
        "nftables" => nft_tables(lab),
        "userspace" => local_routes(lab),
        "ipvs" => ipvs_leftovers(lab),
        other => panic!("no such mode {other}"),
    }
}

/// The userspace mode's routes making service addresses local (its protocol number, 201).
fn local_routes(lab: &Lab) -> Vec<String> {
    let mut routes = Vec::new();
    for family in ["-4", "-6"] {
        let out = lab
            .node
            .exec(
                "ip",
                &[family, "route", "show", "table", "local", "proto", "201"],
            )
            .unwrap();
        routes.extend(out.lines().map(String::from));
    }
    routes
}

#[test]
fn switching_modes_keeps_new_connections_and_leaves_nothing_of_the_old_mode() {
    require_kernel!();
    let mut lab = Lab::new(LabOptions::default()).expect("lab");
    let manifests = lab.write_manifests(&manifest(&lab)).unwrap();
    // The node ran upstream kube-proxy before (in iptables mode, the iptables chains of its
    // ipvs mode, and once in nftables mode).
    lab.node
        .exec(
            "bash",
            &[
                "-c",
                &format!("iptables-restore --noflush <<'EOF'\n{UPSTREAM_KUBE_PROXY}EOF"),
            ],
        )
        .unwrap();
    lab.node
        .exec(
            "nft",
            &["add table ip kube-proxy; add chain ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80"],
        )
        .unwrap();
    assert!(!kube_rules(&lab).is_empty() && !nft_tables(&lab).is_empty());
    lab.start_agent(&manifests, &["--proxy-mode", "iptables"])
        .unwrap();
    let rules = kube_rules(&lab);
    assert!(
        !rules.iter().any(|r| r.contains("10.96.0.1/32")),
        "upstream kube-proxy's service chains are replaced: {rules:?}"
    );
    assert!(rules.iter().any(|r| r.contains("-d 10.96.0.10/32")));
    assert_eq!(nft_tables(&lab), Vec::<String>::new());
    switch_modes(
        &mut lab,
        &manifests,
        &[
            "iptables",
            "nftables",
            "ebpf",
            "iptables",
            "userspace",
            "ebpf",
            "userspace",
            "nftables",
            "iptables",
        ],
    );
}

/// What the ipvs mode leaves on the node: IPVS virtual servers, `kube-ipvs0`, `KUBE-`
/// ipsets, and iptables rules matching them.
fn ipvs_leftovers(lab: &Lab) -> Vec<String> {
    let mut left: Vec<String> = lab
        .node
        .exec("ipvsadm", &["-Ln"])
        .unwrap()
        .lines()
        .filter(|l| ["TCP", "UDP", "SCTP"].iter().any(|p| l.starts_with(p)))
        .map(|l| format!("ipvsadm: {l}"))
        .collect();
    if lab.node.exec("ip", &["link", "show", "kube-ipvs0"]).is_ok() {
        left.push("kube-ipvs0 exists".into());
    }
    left.extend(
        lab.node
            .exec("ipset", &["list", "-n"])
            .unwrap()
            .lines()
            .filter(|l| l.starts_with("KUBE-"))
            .map(|l| format!("ipset {l}")),
    );
    left.extend(
        kube_rules(lab)
            .into_iter()
            .filter(|r| r.contains("--match-set")),
    );
    left
}

/// What `mode` leaves that the `next` mode would not have written: the iptables and ipvs
/// modes share their fixed chains (`KUBE-SERVICES`, `KUBE-POSTROUTING`, ...), so between
/// them only the iptables mode's per-service chains count.
fn leftovers_after_switch(lab: &Lab, mode: &str, next: &str) -> Vec<String> {
    if mode == "iptables" && next == "ipvs" {
        return kube_rules(lab)
            .into_iter()
            .filter(|r| {
                [
                    "KUBE-SVC-",
                    "KUBE-SEP-",
                    "KUBE-EXT-",
                    "KUBE-FW-",
                    "KUBE-NODEPORTS",
                ]
                .iter()
                .any(|c| r.contains(c))
            })
            .collect();
    }
    leftovers(lab, mode)
}

/// The same as [`switching_modes_keeps_new_connections_and_leaves_nothing_of_the_old_mode`]
/// to and from the ipvs mode.
#[test]
#[ignore = "needs IPVS in the kernel (this host's has none): cargo xtask vm-test runs it on Debian's 6.1"]
fn switching_to_and_from_ipvs_keeps_new_connections_and_leaves_nothing_behind() {
    require_kernel!();
    let mut lab = Lab::new(LabOptions::default()).expect("lab");
    let manifests = lab.write_manifests(&manifest(&lab)).unwrap();
    lab.start_agent(&manifests, &["--proxy-mode", "ipvs"])
        .unwrap();
    let out = lab.node.exec("ipvsadm", &["-Ln"]).unwrap();
    assert!(out.contains("TCP  10.96.0.10:80 rr"), "{out}");
    switch_modes(
        &mut lab,
        &manifests,
        &[
            "ipvs",
            "iptables",
            "ipvs",
            "nftables",
            "ipvs",
            "userspace",
            "ipvs",
            "ebpf",
            "ipvs",
        ],
    );
}

/// Restarts the agent in each of `modes` in turn (the first is running) while a client
/// keeps connecting; reports each switch's gap, checks that the service is served and that
/// the previous mode left nothing behind; then `--cleanup` must leave nothing of any mode.
fn switch_modes(lab: &mut Lab, manifests: &Path, modes: &[&str]) {
    let mut current = modes[0];
    for &next in &modes[1..] {
        let connects = ConnectLoop::start(&lab.client.ns, WEB);
        std::thread::sleep(Duration::from_millis(300));
        lab.stop_agent().unwrap();
        lab.start_agent(manifests, &["--proxy-mode", next]).unwrap();
        // The loop runs until the new mode serves (after the userspace proxy, whose
        // listeners go with it, nothing serves while eBPF's programs are verified: seconds
        // on a loaded machine), then half a second more.
        let deadline = Instant::now() + proxy_tests::scaled(Duration::from_secs(10));
        while Instant::now() < deadline
            && !lab
                .client
                .ns
                .run(|| proxy_tests::lab::client::tcp_hello(WEB, Duration::from_secs(1)).is_ok())
                .unwrap_or(false)
        {
            std::thread::sleep(Duration::from_millis(50));
        }
        // And until the old mode's state is gone (the userspace proxy's local routes
        // still refuse some connections until then).
        while Instant::now() < deadline && !leftovers_after_switch(lab, current, next).is_empty() {
            std::thread::sleep(Duration::from_millis(50));
        }
        // Then until the loop itself has been served a few more times: a connection caught
        // by the switch (translated by one datapath, answered through the next) takes the
        // loop's whole 1 s timeout, which a fixed wait here did not always outlast.
        let before = connects.served();
        let settle = Instant::now() + proxy_tests::scaled(Duration::from_secs(5));
        while Instant::now() < settle && connects.served() < before + 25 {
            std::thread::sleep(Duration::from_millis(20));
        }
        let ((ok, failed), gap) = connects.finish_with_gap().unwrap();
        // The figures the issue asks for; not a pass/fail threshold.
        eprintln!(
            "mode switch {current} -> {next}: {ok} new connections served, {} failed ({}), longest gap {:.1} ms",
            failed.len(),
            error_counts(&failed),
            gap.as_secs_f64() * 1000.0
        );
        assert!(
            ok > 20,
            "the client loop made only {ok} connections: {}",
            error_counts(&failed)
        );
        // The old mode's state goes once the new one serves; give it a moment (the ipvs
        // mode's removal runs a few commands, slow under emulation). A connection open
        // while it goes may be lost (the figures above count those).
        let deadline = Instant::now() + proxy_tests::scaled(Duration::from_secs(5));
        let mut left = leftovers_after_switch(lab, current, next);
        while !left.is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(200));
            left = leftovers_after_switch(lab, current, next);
        }
        assert_eq!(
            left,
            Vec::<String>::new(),
            "{current} left state behind after the switch to {next}"
        );
        let hello = lab
            .client
            .ns
            .run(|| proxy_tests::lab::client::tcp_hello(WEB, Duration::from_secs(2)))
            .unwrap();
        assert!(hello.is_ok(), "served after switching to {next}: {hello:?}");
        current = next;
    }
    lab.stop_agent().unwrap();
    let (ok, out) = lab.run_agent_once(&["--cleanup"]).unwrap();
    assert!(ok, "{out}");
    let mut all = vec!["ebpf", "iptables", "nftables", "userspace"];
    if modes.contains(&"ipvs") {
        all.push("ipvs");
    }
    for mode in all {
        assert_eq!(
            leftovers(lab, mode),
            Vec::<String>::new(),
            "{mode} after --cleanup"
        );
    }
}

/// `failed` as "N × error" per distinct error (a switch can fail thousands of connects).
fn error_counts(failed: &[String]) -> String {
    let mut counts = std::collections::BTreeMap::<&str, usize>::new();
    for e in failed {
        *counts.entry(e.as_str()).or_default() += 1;
    }
    let parts: Vec<String> = counts.iter().map(|(e, n)| format!("{n} × {e}")).collect();
    parts.join(", ")
}

/// kube-proxy's behaviour on a kernel without IPVS: the ipvs mode does not start, and says
/// which modules to load. (Where the kernel has IPVS, as in the VM, the mode runs instead:
/// `switching_to_and_from_ipvs_...` covers it.)
#[test]
fn the_ipvs_mode_without_ipvs_in_the_kernel_exits_naming_the_modules() {
    require_kernel!();
    if Path::new("/sys/module/ip_vs").exists() {
        eprintln!("skipped: this kernel has IPVS loaded; the mode runs here");
        return;
    }
    let lab = Lab::new(LabOptions::default()).expect("lab");
    let manifests = lab.write_manifests(&manifest(&lab)).unwrap();
    let (ok, out) = lab
        .run_agent_once(&[
            "--proxy-mode",
            "ipvs",
            "--manifests",
            manifests.to_str().unwrap(),
        ])
        .unwrap();
    if ok || !out.contains("no \"IPVS\" generic netlink family") {
        // A kernel that loads ip_vs on demand has IPVS after all.
        assert!(
            Path::new("/sys/module/ip_vs").exists(),
            "the ipvs mode must refuse to start without IPVS: {out}"
        );
        return;
    }
    assert!(
        out.contains("load the modules ip_vs, ip_vs_rr, ip_vs_wrr, ip_vs_sh, nf_conntrack"),
        "{out}"
    );
    assert!(
        !out.contains("panicked") && !out.contains("stack backtrace"),
        "{out}"
    );
}

/// [W2-2] tenant and fault safety: `cargo xtask test` runs and times these as their own part.
mod safety {
    use super::*;

    /// Two owners of one bpffs root: a second agent, and `--cleanup` during a run, each stop
    /// with one line naming the running agent (its pid and host), and the running agent keeps
    /// its pins and keeps serving. Before, both went ahead and wrote (or removed) the same maps.
    #[test]
    fn a_second_agent_or_cleanup_during_a_run_is_refused_naming_the_holder() {
        require_kernel!();
        let (mut lab, path) = started_lab(&[]);
        let pid = lab.agent().unwrap().pid();
        let maps = lab.bpffs.root().join("maps");
        let pinned = || std::fs::read_dir(&maps).unwrap().count();
        let before = pinned();
        let manifests = path.to_str().unwrap().to_string();
        for args in [vec!["--manifests", manifests.as_str()], vec!["--cleanup"]] {
            let (ok, out) = lab.run_agent_once(&args).unwrap();
            assert!(!ok, "{args:?} ran beside the agent: {out}");
            let refusals: Vec<&str> = out
                .lines()
                .filter(|l| l.contains("another proxy-agent owns"))
                .collect();
            assert_eq!(refusals.len(), 1, "{args:?}: {out}");
            assert!(
                refusals[0].contains(&format!("pid {pid} on ")),
                "{args:?} does not name the holder: {out}"
            );
        }
        assert_eq!(pinned(), before, "the running agent's maps are all pinned");
        let served = lab
            .client
            .ns
            .run(|| {
                (0..10)
                    .filter(|_| {
                        proxy_tests::lab::client::tcp_hello(WEB, Duration::from_secs(2)).is_ok()
                    })
                    .count()
            })
            .unwrap();
        assert_eq!(served, 10, "the running agent still serves");
        // Its lock goes with it.
        lab.stop_agent().unwrap();
        let (ok, out) = lab.run_agent_once(&["--cleanup"]).unwrap();
        assert!(ok, "--cleanup after the agent stopped: {out}");
        assert!(
            !lab.bpffs.root().exists(),
            "--cleanup leaves the root behind"
        );
    }

    /// A mode switch where the new mode cannot program every Service (here the eBPF
    /// SERVICES map has room for one of two): the old mode's state stays and keeps serving
    /// the Service the new mode lacks, and goes once the new mode serves everything. Before,
    /// the old mode's state went right after the first sync and that Service went dark.
    #[test]
    fn a_mode_switch_keeps_the_old_modes_state_while_the_new_one_cannot_serve_everything() {
        require_kernel!();
        let mut lab = Lab::new(LabOptions::default()).expect("lab");
        let ips: Vec<Ipv4Addr> = lab.backends.iter().map(|p| p.ip).collect();
        let big = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 20), 80);
        let web =
            |ips: &[Ipv4Addr]| service("web", *WEB.ip(), &[("http", "TCP", 80, TCP_PORT)], ips);
        let mut both = web(&ips);
        both.push_str(&service(
            "big",
            *big.ip(),
            &[("http", "TCP", 80, TCP_PORT)],
            &ips,
        ));
        let manifests = lab.write_manifests(&both).unwrap();
        lab.start_agent(&manifests, &["--proxy-mode", "iptables"])
            .unwrap();
        lab.stop_agent().unwrap();
        // SERVICES has room for one Service (a header and three slots) and not two.
        lab.start_agent(
            &manifests,
            &["--proxy-mode", "ebpf", "--services-map-size", "6"],
        )
        .unwrap();
        let log = lab.agent().unwrap().log_text();
        assert!(
            log.contains("other proxy modes' state kept on the node"),
            "{log}"
        );
        assert!(!kube_rules(&lab).is_empty(), "the iptables rules went");
        let served = |to: SocketAddrV4| {
            lab.client
                .ns
                .run(move || {
                    (0..10)
                        .filter(|_| {
                            proxy_tests::lab::client::tcp_hello(to, Duration::from_secs(2)).is_ok()
                        })
                        .count()
                })
                .unwrap()
        };
        assert_eq!(served(WEB), 10, "the Service eBPF serves");
        assert_eq!(
            served(big),
            10,
            "the Service only the old mode's rules serve"
        );
        assert_eq!(kept_gauge(&lab), "1", "proxy_agent_other_modes_state_kept");

        // Once eBPF serves every Service, the old mode's state goes.
        lab.write_manifests(&web(&ips)).unwrap();
        let deadline = Instant::now() + proxy_tests::scaled(Duration::from_secs(10));
        while !kube_rules(&lab).is_empty() {
            assert!(
                Instant::now() < deadline,
                "the iptables rules stayed: {:?}",
                kube_rules(&lab)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        assert_eq!(served(WEB), 10);
        assert_eq!(kept_gauge(&lab), "0");
    }

    /// The userspace mode relays after the old mode's DNAT has run, so the old rules would
    /// send the Services it serves to the endpoints of the day of the switch. They go after
    /// its first sync even when a frontend cannot be opened (here a NodePort another
    /// process holds), and that frontend is reported instead.
    #[test]
    fn a_switch_to_userspace_removes_old_rules_that_would_shadow_what_it_serves() {
        require_kernel!();
        let mut lab = Lab::new(LabOptions::default()).expect("lab");
        let ips: Vec<Ipv4Addr> = lab.backends.iter().map(|p| p.ip).collect();
        let web =
            |ips: &[Ipv4Addr]| service("web", *WEB.ip(), &[("http", "TCP", 80, TCP_PORT)], ips);
        let manifests = lab.write_manifests(&web(&ips)).unwrap();
        lab.start_agent(&manifests, &["--proxy-mode", "iptables"])
            .unwrap();
        lab.stop_agent().unwrap();
        assert!(!kube_rules(&lab).is_empty(), "iptables programmed nothing");

        // While no agent runs, web shrinks to one endpoint, and a NodePort Service arrives
        // whose port another process on the node holds.
        const HELD: u16 = 30090;
        let held = lab
            .node
            .run(|| std::net::TcpListener::bind(("0.0.0.0", HELD)))
            .unwrap()
            .expect("holding the NodePort");
        let blocked = format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: blocked, namespace: lab}}\nspec:\n  type: NodePort\n  clusterIP: 10.96.0.21\n  ports:\n  - {{name: http, protocol: TCP, port: 80, targetPort: {TCP_PORT}, nodePort: {HELD}}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: blocked-1\n  namespace: lab\n  labels: {{kubernetes.io/service-name: blocked}}\naddressType: IPv4\nports:\n- {{name: http, protocol: TCP, port: {TCP_PORT}}}\nendpoints:\n- addresses: [\"{}\"]\n  conditions: {{ready: true}}\n---\n",
            ips[0]
        );
        lab.write_manifests(&(web(&ips[..1]) + &blocked)).unwrap();
        lab.start_agent(&manifests, &["--proxy-mode", "userspace"])
            .unwrap();

        let deadline = Instant::now() + proxy_tests::scaled(Duration::from_secs(10));
        while !kube_rules(&lab).is_empty() {
            assert!(
                Instant::now() < deadline,
                "the old rules stayed: {:?}\n{}",
                kube_rules(&lab),
                lab.agent().unwrap().log_text()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        let reached: std::collections::BTreeSet<String> = lab
            .client
            .ns
            .run(|| {
                (0..12)
                    .map(|_| {
                        proxy_tests::lab::client::tcp_hello(WEB, Duration::from_secs(2))
                            .expect("web answers")
                    })
                    .collect()
            })
            .unwrap();
        let only = std::collections::BTreeSet::from([lab.backends[0].name.clone()]);
        assert_eq!(reached, only, "web reached endpoints it no longer has");
        let log = lab.agent().unwrap().log_text();
        assert!(
            log.contains("failed=1"),
            "the held NodePort is not reported: {log}"
        );
        assert_eq!(kept_gauge(&lab), "0", "proxy_agent_other_modes_state_kept");
        drop(held);
    }

    /// `proxy_agent_other_modes_state_kept` from the agent's /metrics (its default address).
    fn kept_gauge(lab: &Lab) -> String {
        use std::io::{Read, Write};
        lab.node
            .run(|| {
                let mut s = std::net::TcpStream::connect("127.0.0.1:10249").unwrap();
                s.write_all(b"GET /metrics HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
                    .unwrap();
                let mut text = String::new();
                s.read_to_string(&mut text).unwrap();
                text.lines()
                    .find_map(|l| l.strip_prefix("proxy_agent_other_modes_state_kept "))
                    .unwrap_or_default()
                    .to_string()
            })
            .unwrap()
    }
}
