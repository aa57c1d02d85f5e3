//! `deploy/`: every object parses as its Kubernetes type, the DaemonSet matches the agent's
//! defaults, the ConfigMap's config loads, and the monitoring assets only use metric names
//! the agent exports.

use std::path::PathBuf;

use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{ConfigMap, ServiceAccount},
    rbac::v1::{ClusterRole, ClusterRoleBinding},
};
use proxy_agent::metrics::Metrics;
use serde::Deserialize;
use serde_yaml::Value;

fn deploy(file: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn documents(text: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|d| Value::deserialize(d).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

fn kind(v: &Value) -> &str {
    v["kind"].as_str().unwrap_or("")
}

fn find<T: serde::de::DeserializeOwned>(file: &str, k: &str) -> T {
    let doc = documents(&deploy(file))
        .into_iter()
        .find(|d| kind(d) == k)
        .unwrap_or_else(|| panic!("no {k} in {file}"));
    serde_yaml::from_value(doc).unwrap_or_else(|e| panic!("{k} in {file}: {e}"))
}

#[test]
fn every_known_object_parses_as_its_type() {
    let mut seen = Vec::new();
    for file in ["rbac.yaml", "configmap.yaml", "daemonset.yaml"] {
        for doc in documents(&deploy(file)) {
            let k = kind(&doc).to_string();
            let ok = match k.as_str() {
                "ServiceAccount" => serde_yaml::from_value::<ServiceAccount>(doc).map(|_| ()),
                "ClusterRole" => serde_yaml::from_value::<ClusterRole>(doc).map(|_| ()),
                "ClusterRoleBinding" => {
                    serde_yaml::from_value::<ClusterRoleBinding>(doc).map(|_| ())
                }
                "ConfigMap" => serde_yaml::from_value::<ConfigMap>(doc).map(|_| ()),
                "DaemonSet" => serde_yaml::from_value::<DaemonSet>(doc).map(|_| ()),
                other => panic!("{file}: unexpected kind {other}"),
            };
            ok.unwrap_or_else(|e| panic!("{file} {k}: {e}"));
            seen.push(k);
        }
    }
    seen.sort();
    assert_eq!(
        seen,
        [
            "ClusterRole",
            "ClusterRoleBinding",
            "ConfigMap",
            "DaemonSet",
            "ServiceAccount"
        ]
    );
}

#[test]
fn the_cluster_role_allows_what_the_agent_watches() {
    let role: ClusterRole = find("rbac.yaml", "ClusterRole");
    let allows = |group: &str, resource: &str, verb: &str| {
        role.rules.iter().flatten().any(|r| {
            r.api_groups.iter().flatten().any(|g| g == group)
                && r.resources.iter().flatten().any(|x| x == resource)
                && r.verbs.iter().any(|v| v == verb)
        })
    };
    for (group, resource) in [
        ("", "services"),
        ("discovery.k8s.io", "endpointslices"),
        ("", "nodes"),
    ] {
        for verb in ["list", "watch"] {
            assert!(allows(group, resource, verb), "{verb} {resource}");
        }
    }
    for verb in ["create", "patch"] {
        assert!(allows("", "events", verb), "{verb} events");
    }
}

#[test]
fn the_daemonset_matches_the_agents_defaults() {
    let ds: DaemonSet = find("daemonset.yaml", "DaemonSet");
    let pod = ds.spec.unwrap().template.spec.unwrap();
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(pod.service_account_name.as_deref(), Some("proxy-agent"));
    let c = &pod.containers[0];
    let port_of = |probe: &Option<k8s_openapi::api::core::v1::Probe>| {
        let get = probe.as_ref().unwrap().http_get.as_ref().unwrap();
        (get.path.clone().unwrap(), get.port.clone())
    };
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int;
    assert_eq!(
        port_of(&c.readiness_probe),
        ("/healthz".to_string(), Int(10256))
    );
    assert_eq!(
        port_of(&c.liveness_probe),
        ("/livez".to_string(), Int(10256))
    );
    let ports: Vec<i32> = c.ports.iter().flatten().map(|p| p.container_port).collect();
    assert_eq!(
        ports,
        vec![10256, 10249],
        "kube-proxy's healthz and metrics ports"
    );
    let mounts: Vec<&str> = c
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| m.mount_path.as_str())
        .collect();
    for path in ["/sys/fs/bpf", "/run/xtables.lock", "/var/lib/proxy-agent"] {
        assert!(mounts.contains(&path), "{path} not mounted: {mounts:?}");
    }
    let env = c
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "NODE_NAME")
        .unwrap();
    let field = env.value_from.as_ref().unwrap().field_ref.as_ref().unwrap();
    assert_eq!(field.field_path, "spec.nodeName");
    let args = c.command.clone().unwrap();
    assert!(args.contains(&"--config=/var/lib/proxy-agent/config.conf".to_string()));
    assert!(args.contains(&"--hostname-override=$(NODE_NAME)".to_string()));
    // The socket hooks' cgroup is the host's, mounted where the flag says.
    let cgroup = args
        .iter()
        .find_map(|a| a.strip_prefix("--cgroup-path="))
        .expect("--cgroup-path");
    assert!(mounts.contains(&cgroup), "{cgroup} not mounted: {mounts:?}");
    let caps = c
        .security_context
        .as_ref()
        .unwrap()
        .capabilities
        .as_ref()
        .unwrap();
    let added: Vec<&str> = caps.add.iter().flatten().map(String::as_str).collect();
    assert!(
        added.contains(&"BPF") && added.contains(&"NET_ADMIN"),
        "{added:?}"
    );
    assert_eq!(caps.drop.clone().unwrap(), vec!["ALL".to_string()]);
    // The bpffs default root lives on the mounted host bpffs.
    assert!(proxy_agent::datapath::pins::DEFAULT_BPFFS_ROOT.starts_with("/sys/fs/bpf/"));
}

#[test]
fn the_configmap_carries_the_example_config_and_it_loads() {
    let cm: ConfigMap = find("configmap.yaml", "ConfigMap");
    let text = cm.data.unwrap()["config.conf"].clone();
    assert_eq!(
        text.trim(),
        deploy("config/proxy-agent.yaml").trim(),
        "keep them equal"
    );
    let settings = proxy_agent::config::parse(&text).unwrap();
    assert_eq!(settings.mode.as_deref(), Some("ebpf"));
    assert_eq!(
        settings.healthz_bind_address.as_deref(),
        Some("0.0.0.0:10256")
    );
}

/// Metric names in a PromQL expression (identifiers of ours or kube-proxy's, and `up`).
fn metric_names(expr: &str) -> Vec<String> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("kubeproxy_") || w.starts_with("proxy_agent_"))
        .map(|w| {
            w.trim_end_matches("_bucket")
                .trim_end_matches("_count")
                .trim_end_matches("_sum")
                .to_string()
        })
        .collect()
}

#[test]
fn monitoring_assets_use_only_metrics_the_agent_exports() {
    let exported = Metrics::new().names;
    let mut used = Vec::new();
    let rule = documents(&deploy("monitoring/prometheusrule.yaml")).remove(0);
    assert_eq!(kind(&rule), "PrometheusRule");
    let alerts: Vec<&str> = rule["spec"]["groups"][0]["rules"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|r| {
            used.extend(metric_names(r["expr"].as_str().unwrap()));
            r["alert"].as_str().unwrap()
        })
        .collect();
    for alert in [
        "KubeProxyDown",
        "ServiceEndpointsDown",
        "KubeProxyHighSyncLatency",
    ] {
        assert!(alerts.contains(&alert), "{alert} missing: {alerts:?}");
    }
    let dashboard: serde_json::Value =
        serde_json::from_str(&deploy("monitoring/dashboard.json")).unwrap();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            used.extend(metric_names(target["expr"].as_str().unwrap()));
        }
    }
    assert!(used.len() > 10);
    for name in used {
        assert!(
            exported.contains(&name),
            "{name} is not exported; exported: {exported:?}"
        );
    }
}
