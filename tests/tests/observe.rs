//! What operators look at, over real HTTP against a running agent in the lab: /healthz,
//! /livez, /metrics, /proxyMode, and the --config file with flags overriding it.

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddrV4, TcpStream},
    time::{Duration, Instant},
};

use proxy_tests::{
    kernel::kernel_version,
    lab::{client, manifest::service, Lab, LabOptions, TCP_PORT},
    require_kernel,
};

const WEB: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 10), 80);

/// GET `path` from `addr` inside the node namespace: (status, body).
fn get(lab: &Lab, addr: SocketAddrV4, path: &str) -> (u16, String) {
    let path = path.to_string();
    lab.node
        .run(move || {
            let mut s = TcpStream::connect_timeout(&addr.into(), Duration::from_secs(2))
                .unwrap_or_else(|e| panic!("connecting to {addr}: {e}"));
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            write!(
                s,
                "GET {path} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n"
            )
            .unwrap();
            let mut text = String::new();
            s.read_to_string(&mut text).unwrap();
            let status = text
                .split_whitespace()
                .nth(1)
                .and_then(|c| c.parse().ok())
                .unwrap_or(0);
            let body = text
                .split_once("\r\n\r\n")
                .map(|b| b.1.to_string())
                .unwrap_or_default();
            (status, body)
        })
        .unwrap()
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no series {series} in\n{text}"))
}

/// Waits (10 s at most) until `/metrics` at `addr` shows `series` at `value`.
fn wait_for_metric(lab: &Lab, addr: SocketAddrV4, series: &str, value: f64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, now) = get(lab, addr, "/metrics");
        if metric(&now, series) == value {
            return;
        }
        assert!(Instant::now() < deadline, "{series} never {value}:\n{now}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn health_metrics_and_config_over_http() {
    require_kernel!();
    let mut lab = Lab::new(LabOptions::default()).expect("lab");
    let ips: Vec<Ipv4Addr> = lab.backends.iter().map(|p| p.ip).collect();
    let web = |ips: &[Ipv4Addr]| service("web", *WEB.ip(), &[("http", "TCP", 80, TCP_PORT)], ips);
    let manifests = lab.write_manifests(&web(&ips)).unwrap();
    // The file sets both addresses; the metrics flag overrides the file's. SERVICES has room
    // for this service (1 + 3 entries) and little more, so a bigger change can stall syncs.
    let config = lab.dir.path().join("config.yaml");
    std::fs::write(
        &config,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
healthzBindAddress: 0.0.0.0:20256
metricsBindAddress: 127.0.0.1:30249
iptables: {syncPeriod: 0s}
winkernel: {enableDSR: false}
conntrack: {tcpEstablishedTimeout: 2h}
---
apiVersion: proxy-agent.io/v1alpha1
kind: ProxyAgentConfiguration
ebpf:
  servicesMapSize: 6
  syncPeriod: 1s
",
    )
    .unwrap();
    let config = config.to_str().unwrap().to_string();
    lab.start_agent(
        &manifests,
        &[
            "--config",
            &config,
            "--metrics-bind-address",
            "127.0.0.1:20249",
        ],
    )
    .unwrap();
    let log = lab.agent().unwrap().log_text();
    assert!(
        log.contains("ignored: winkernel"),
        "ignored fields are named once: {log}"
    );
    // Kernel conntrack tuning happens only in a node's initial network namespace; the lab's
    // node namespace is not one, and its sysctls stay as they were.
    let established = lab
        .node
        .exec(
            "sysctl",
            &["-n", "net.netfilter.nf_conntrack_tcp_timeout_established"],
        )
        .unwrap();
    assert_ne!(
        established.trim(),
        "7200",
        "kernel conntrack tuned outside the initial netns"
    );
    assert!(
        log.contains("kernel conntrack left alone: not the node's initial network namespace"),
        "{log}"
    );

    let healthz = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 20256);
    let metrics = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 20249);
    let (code, body) = get(&lab, healthz, "/healthz");
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"lastUpdated\""), "{body}");
    assert_eq!(get(&lab, healthz, "/livez").0, 200);
    assert_eq!(get(&lab, metrics, "/proxyMode"), (200, "ebpf".to_string()));
    let (code, before) = get(&lab, metrics, "/metrics");
    assert_eq!(code, 200);
    for (name, kind) in [
        ("kubeproxy_sync_proxy_rules_duration_seconds", "histogram"),
        ("kubeproxy_sync_proxy_rules_last_timestamp_seconds", "gauge"),
        (
            "kubeproxy_network_programming_duration_seconds",
            "histogram",
        ),
        (
            "kubeproxy_sync_proxy_rules_service_changes_total",
            "counter",
        ),
        (
            "kubeproxy_sync_proxy_rules_endpoint_changes_total",
            "counter",
        ),
        (
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "gauge",
        ),
        ("kubeproxy_proxy_healthz_total", "counter"),
        ("proxy_agent_service_ports", "gauge"),
    ] {
        assert!(
            before.contains(&format!("# TYPE {name} {kind}\n")),
            "{name} {kind}:\n{before}"
        );
    }
    assert_eq!(
        metric(&before, "kubeproxy_proxy_healthz_total{code=\"200\"}"),
        1.0
    );
    assert_eq!(
        metric(&before, "proxy_agent_service_ports{mode=\"ebpf\"}"),
        1.0
    );
    assert_eq!(metric(&before, "proxy_agent_backends{mode=\"ebpf\"}"), 3.0);
    let endpoint_changes = metric(&before, "kubeproxy_sync_proxy_rules_endpoint_changes_total");

    // Traffic shows up per service port (the agent reads the datapath every 10 s).
    let n = lab
        .client
        .ns
        .run(|| {
            (0..20)
                .filter(|_| {
                    proxy_tests::lab::client::tcp_hello(WEB, Duration::from_secs(2)).is_ok()
                })
                .count()
        })
        .unwrap();
    assert_eq!(n, 20);
    let series = "{namespace=\"lab\",port=\"http\",protocol=\"TCP\",service=\"web\"}";
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (_, now) = get(&lab, metrics, "/metrics");
        let name = format!("proxy_agent_service_connections_total{series}");
        if now.contains(&name) && metric(&now, &name) >= 20.0 {
            assert!(metric(&now, &format!("proxy_agent_service_packets_total{series}")) >= 80.0);
            assert!(metric(&now, &format!("proxy_agent_service_bytes_total{series}")) > 0.0);
            // Real handshakes confirm their flows (the client's ACK acknowledges the
            // backend's SYN-ACK); none looks blind.
            let event = |e: &str| {
                metric(
                    &now,
                    &format!("proxy_agent_ebpf_datapath_events{{event=\"{e}\"}}"),
                )
            };
            assert!(event("flow_confirmed") >= 20.0, "{now}");
            assert_eq!(event("blind_ack"), 0.0);
            break;
        }
        assert!(Instant::now() < deadline, "no per-service counters:\n{now}");
        std::thread::sleep(Duration::from_millis(500));
    }

    // A change that programs: counters grow, health stays.
    lab.write_manifests(&web(&ips[..2])).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (_, now) = get(&lab, metrics, "/metrics");
        if metric(&now, "proxy_agent_backends{mode=\"ebpf\"}") == 2.0 {
            assert_eq!(
                metric(&now, "kubeproxy_sync_proxy_rules_endpoint_changes_total"),
                endpoint_changes + 1.0
            );
            assert!(metric(&now, "kubeproxy_network_programming_duration_seconds_count") >= 2.0);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the change was not programmed:\n{now}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(get(&lab, healthz, "/healthz").0, 200);

    // A Service that cannot be programmed (SERVICES is full): reported, retried, and held
    // against nobody: /healthz and /livez stay 200 past 2 x syncPeriod and the other
    // Service keeps serving (before, one such Service turned every node's probes red).
    let mut yaml = web(&ips[..2]);
    yaml.push_str(&service(
        "big",
        Ipv4Addr::new(10, 96, 0, 20),
        &[("", "TCP", 80, TCP_PORT)],
        &ips,
    ));
    lab.write_manifests(&yaml).unwrap();
    wait_for_metric(&lab, metrics, "proxy_agent_unprogrammed_service_ports", 1.0);
    assert!(lab
        .agent()
        .unwrap()
        .log_text()
        .contains("eBPF map SERVICES is full"));
    std::thread::sleep(Duration::from_millis(2500)); // > 2 x syncPeriod (1 s)
    for path in ["/healthz", "/livez"] {
        let (code, body) = get(&lab, healthz, path);
        assert_eq!(code, 200, "{path}: {body}");
    }
    let served = lab
        .client
        .ns
        .run(|| {
            (0..20)
                .filter(|_| client::tcp_hello(WEB, Duration::from_secs(2)).is_ok())
                .count()
        })
        .unwrap();
    assert_eq!(served, 20, "the other Service serves");
    let (_, after) = get(&lab, metrics, "/metrics");
    assert!(
        !after.contains("kubeproxy_proxy_healthz_total{code=\"503\"}"),
        "no 503 was ever answered:\n{after}"
    );
    // Undone, the failure clears.
    lab.write_manifests(&web(&ips)).unwrap();
    wait_for_metric(&lab, metrics, "proxy_agent_unprogrammed_service_ports", 0.0);
}

#[test]
fn an_invalid_config_stops_the_agent_with_the_field_path() {
    require_kernel!();
    let lab = Lab::new(LabOptions::default()).expect("lab");
    let config = lab.dir.path().join("bad.yaml");
    std::fs::write(
        &config,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\niptables: {masqueradeBit: 99}\n",
    )
    .unwrap();
    let (ok, out) = lab
        .run_agent_once(&[
            "--config",
            config.to_str().unwrap(),
            "--manifests",
            "/nonexistent",
        ])
        .unwrap();
    assert!(!ok);
    assert!(
        out.trim()
            .ends_with("iptables.masqueradeBit: 99 is out of range (0-31)"),
        "{out}"
    );
    assert_eq!(out.trim().lines().count(), 1, "{out}");
}

#[test]
fn verbosity_4_logs_each_new_flow_from_the_datapath() {
    require_kernel!();
    let mut lab = Lab::new(LabOptions::default()).expect("lab");
    let ips: Vec<Ipv4Addr> = lab.backends.iter().map(|p| p.ip).collect();
    let mut yaml = service("web", *WEB.ip(), &[("http", "TCP", 80, TCP_PORT)], &ips);
    let dead = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 99), 80);
    yaml.push_str(&service(
        "dead",
        *dead.ip(),
        &[("http", "TCP", 80, TCP_PORT)],
        &[],
    ));
    let manifests = lab.write_manifests(&yaml).unwrap();
    lab.start_agent(&manifests, &["-v", "4"]).unwrap();
    let (port, refused) = lab
        .client
        .ns
        .run(move || {
            let s = TcpStream::connect_timeout(&WEB.into(), Duration::from_secs(2)).unwrap();
            let port = s.local_addr().unwrap().port();
            let refused = TcpStream::connect_timeout(&dead.into(), Duration::from_secs(2)).is_err();
            (port, refused)
        })
        .unwrap();
    assert!(refused);
    let wanted = format!(
        "new flow proto 6 {}:{port} -> {WEB} to backend ",
        lab.client.ip
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let log = lab.agent().unwrap().log_text();
        if log.contains(&wanted) && log.contains(&format!("-> {dead}: no ready endpoint")) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no per-flow debug line {wanted:?} in:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // What `kubectl logs` shows: plain text (stderr is a file here, not a terminal), and
    // debug lines from this agent and its datapath only, not its dependencies' polling.
    let log = lab.agent().unwrap().log_text();
    assert!(!log.contains('\u{1b}'), "ANSI escape codes in:\n{log}");
    let foreign: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(" DEBUG ") || l.contains(" TRACE "))
        .filter(|l| {
            let target = l.split_whitespace().nth(2).unwrap_or("");
            !(target.starts_with("proxy_agent") || target.starts_with("proxy_ebpf"))
        })
        .collect();
    assert!(
        foreign.is_empty(),
        "-v 4 printed other crates' debug output: {:?}",
        &foreign[..foreign.len().min(5)]
    );
}

#[test]
fn auto_mode_runs_the_first_mode_this_kernel_supports_and_says_why() {
    require_kernel!();
    let mut lab = Lab::new(LabOptions::default()).expect("lab");
    let ips: Vec<Ipv4Addr> = lab.backends.iter().map(|p| p.ip).collect();
    let manifests = lab
        .write_manifests(&service(
            "web",
            *WEB.ip(),
            &[("http", "TCP", 80, TCP_PORT)],
            &ips,
        ))
        .unwrap();
    let metrics = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 10249);
    let served = |lab: &Lab| {
        lab.client
            .ns
            .run(|| {
                // The eBPF mode may still be attaching to the last pod link.
                (0..50).any(|_| {
                    let ok = client::tcp_hello(WEB, Duration::from_millis(200)).is_ok();
                    if !ok {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    ok
                })
            })
            .unwrap()
    };
    // This kernel loads the eBPF datapath: auto is eBPF.
    let log = lab
        .start_agent(&manifests, &["--proxy-mode", "auto"])
        .unwrap()
        .log_text();
    assert!(log.contains("auto: choosing ebpf"), "{log}");
    assert!(log.contains("Using ebpf Proxier"), "{log}");
    assert_eq!(get(&lab, metrics, "/proxyMode"), (200, "ebpf".to_string()));
    assert!(served(&lab));
    lab.stop_agent().unwrap();
    // A datapath object that does not load (as on a kernel without usable BPF): the next
    // mode in the order, nftables, with the reason eBPF was passed over; before 5.13, as
    // kube-proxy's, the nftables mode is passed over too (the agent started as an operator
    // would: without the VM runner's skip of that check), and iptables runs.
    lab.runner_args = false;
    let old_kernel = kernel_version() < (5, 13);
    let next = if old_kernel { "iptables" } else { "nftables" };
    let log = lab
        .start_agent(
            &manifests,
            &[
                "--proxy-mode",
                "auto",
                "--ebpf-object",
                "/nonexistent/proxy-ebpf",
            ],
        )
        .unwrap()
        .log_text();
    assert!(log.contains(&format!("auto: choosing {next}")), "{log}");
    assert!(
        log.contains("/nonexistent/proxy-ebpf"),
        "the reason is logged: {log}"
    );
    if old_kernel {
        assert!(
            log.contains("the nftables mode needs kernel 5.13 or later"),
            "nftables passed over with the reason: {log}"
        );
    }
    assert_eq!(get(&lab, metrics, "/proxyMode"), (200, next.to_string()));
    assert!(served(&lab));
}

/// [W2-2] tenant and fault safety: `cargo xtask test` runs and times these as their own part.
mod safety {
    use super::*;

    /// A slowloris against the health port (the DaemonSet's default, 0.0.0.0:10256): 2 000
    /// connections that send half a header and stall. A fresh /healthz still answers at once,
    /// the agent holds no more descriptors than its connection cap allows, and a manifest change
    /// is still programmed. Before, every stalled connection kept a descriptor and a task for as
    /// long as the client liked.
    #[test]
    fn slow_clients_neither_starve_health_nor_exhaust_descriptors() {
        require_kernel!();
        const STALLED: usize = 2000;
        // The test holds the stalled connections' descriptors itself.
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
        if (limit.rlim_max as usize) < STALLED + 256 {
            eprintln!(
                "skipped: this process may open {} descriptors, the test needs {}",
                limit.rlim_max,
                STALLED + 256
            );
            return;
        }
        limit.rlim_cur = limit.rlim_max;
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };

        let mut lab = Lab::new(LabOptions::default()).expect("lab");
        let ips: Vec<Ipv4Addr> = lab.backends.iter().map(|p| p.ip).collect();
        let web =
            |ips: &[Ipv4Addr]| service("web", *WEB.ip(), &[("http", "TCP", 80, TCP_PORT)], ips);
        let manifests = lab.write_manifests(&web(&ips)).unwrap();
        lab.start_agent(&manifests, &[]).unwrap();
        let healthz = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 10256);
        let metrics = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 10249);
        assert_eq!(get(&lab, healthz, "/healthz").0, 200);
        let pid = lab.agent().unwrap().pid();
        let before = open_fds(pid);

        let stalled: Vec<TcpStream> = lab
            .node
            .run(move || {
                (0..STALLED)
                    .filter_map(|_| {
                        let mut s = TcpStream::connect(healthz).ok()?;
                        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: ag").ok()?;
                        Some(s)
                    })
                    .collect()
            })
            .unwrap();
        assert_eq!(stalled.len(), STALLED, "the kernel took every connection");

        let started = Instant::now();
        let (code, body) = get(&lab, healthz, "/healthz");
        let took = started.elapsed();
        assert_eq!(code, 200, "{body}");
        assert!(
            took <= proxy_tests::scaled(Duration::from_secs(1)),
            "/healthz took {took:?} behind {STALLED} stalled connections"
        );
        let during = open_fds(pid);
        let cap = proxy_agent::health::http::AGENT_CONNECTIONS;
        assert!(
            during <= before + cap + 8,
            "the agent holds {during} descriptors ({before} before; cap {cap})"
        );

        // A change is still programmed while they stall.
        lab.write_manifests(&web(&ips[..2])).unwrap();
        let deadline = Instant::now() + proxy_tests::scaled(Duration::from_secs(5));
        loop {
            let (_, now) = get(&lab, metrics, "/metrics");
            if metric(&now, "proxy_agent_backends{mode=\"ebpf\"}") == 2.0 {
                assert!(
                    metric(
                        &now,
                        "proxy_agent_http_connections_shed_total{server=\"agent\"}"
                    ) >= (STALLED - cap) as f64,
                    "the oldest stalled connections were shed:\n{now}"
                );
                assert_eq!(
                    metric(&now, "proxy_agent_http_connection_limit{server=\"agent\"}"),
                    cap as f64
                );
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the change was not programmed:\n{now}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        drop(stalled);
    }

    /// A sync that hangs (here `iptables-restore`, wedged by a wrapper as a stuck xtables lock
    /// or a huge ruleset would) must not silence the node's health answers: /healthz says 503
    /// once the change has waited past 2 x syncPeriod, /metrics and a healthCheckNodePort
    /// answer, and when the tool returns the change lands and /healthz is 200 again. Before,
    /// every server shared the sync's thread and none answered until the sync ended, so load
    /// balancers and the liveness probe saw a dead node instead of a reason.
    #[test]
    fn a_hung_sync_leaves_health_and_metrics_answering() {
        require_kernel!();
        let mut lab = Lab::new(LabOptions::default()).expect("lab");
        let ips: Vec<Ipv4Addr> = lab.backends.iter().map(|p| p.ip).collect();
        let lb = "apiVersion: v1\nkind: Service\nmetadata: {name: lb, namespace: lab}\nspec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.26\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 32100\n  ports:\n  - {name: http, protocol: TCP, port: 80, targetPort: 8080, nodePort: 30083}\n---\n";
        let web = |ips: &[Ipv4Addr]| {
            lb.to_string() + &service("web", *WEB.ip(), &[("http", "TCP", 80, TCP_PORT)], ips)
        };
        let manifests = lab.write_manifests(&web(&ips)).unwrap();
        // The wrapper passes through until the test creates `wedge`, then says so in `wedged`
        // and waits for `wedge` to go.
        let tools = lab.dir.path().join("tools");
        std::fs::create_dir(&tools).unwrap();
        let (wedge, wedged) = (tools.join("wedge"), tools.join("wedged"));
        for tool in ["iptables-restore", "ip6tables-restore"] {
            let real = which(tool);
            let script = tools.join(tool);
            std::fs::write(
                &script,
                format!(
                    "#!/bin/sh\nif [ -e {w} ]; then touch {d}; while [ -e {w} ]; do sleep 0.1; done; fi\nexec {real} \"$@\"\n",
                    w = wedge.display(),
                    d = wedged.display(),
                    real = real.display(),
                ),
            )
            .unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        lab.tools_first = Some(tools.clone());
        let config = lab.dir.path().join("config.yaml");
        std::fs::write(
            &config,
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\niptables: {syncPeriod: 1s, minSyncPeriod: 0s}\n",
        )
        .unwrap();
        lab.start_agent(
            &manifests,
            &[
                "--proxy-mode",
                "iptables",
                "--config",
                config.to_str().unwrap(),
            ],
        )
        .unwrap();
        let healthz = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 10256);
        let metrics = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 10249);
        let service_health = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 32100);
        assert_eq!(get(&lab, healthz, "/healthz").0, 200);
        let backends = "proxy_agent_backends{mode=\"iptables\"}";
        wait_for_metric(&lab, metrics, backends, 3.0);

        std::fs::write(&wedge, "").unwrap();
        lab.write_manifests(&web(&ips[..2])).unwrap();
        let deadline = Instant::now() + proxy_tests::scaled(Duration::from_secs(10));
        while !wedged.exists() {
            assert!(
                Instant::now() < deadline,
                "no sync reached iptables-restore"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_millis(2500)); // > 2 x syncPeriod (1 s)
        assert!(wedged.exists() && wedge.exists());
        let (code, body) = get(&lab, healthz, "/healthz");
        assert_eq!(code, 503, "a change waits on a hung sync: {body}");
        assert_eq!(get(&lab, metrics, "/metrics").0, 200);
        let (code, body) = get(&lab, service_health, "/");
        assert!(
            body.contains("\"localEndpoints\""),
            "the healthCheckNodePort answers ({code}): {body}"
        );

        std::fs::remove_file(&wedge).unwrap();
        let deadline = Instant::now() + proxy_tests::scaled(Duration::from_secs(10));
        loop {
            let (code, _) = get(&lab, healthz, "/healthz");
            let (_, now) = get(&lab, metrics, "/metrics");
            if code == 200 && metric(&now, backends) == 2.0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the sync never completed:\n{now}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Where `PATH` finds `tool`.
    fn which(tool: &str) -> std::path::PathBuf {
        std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .unwrap_or_default()
            .into_iter()
            .chain(["/usr/sbin".into(), "/sbin".into()])
            .map(|d| d.join(tool))
            .find(|p| p.is_file())
            .unwrap_or_else(|| panic!("{tool} not found"))
    }

    /// Open descriptors of process `pid`.
    fn open_fds(pid: u32) -> usize {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|d| d.count())
            .unwrap_or(0)
    }
}
