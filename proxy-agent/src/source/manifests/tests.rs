use std::{fs, net::SocketAddr, os::unix::fs::symlink, time::Duration};

use tokio::sync::mpsc;

use super::*;
use crate::model::{DesiredState, NodeContext, ObjectName, Protocol, ServicePortName};

const SETTLE: Duration = Duration::from_millis(100);

const MIXED: &str = r#"
# A Service with a named and a numeric target port, served by two slices.
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIP: 10.96.0.10
  ports:
    - {name: http, port: 80, targetPort: http}
    - {name: metrics, port: 9090, targetPort: 9100}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: shop
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports:
  - {name: http, port: 8080, protocol: TCP}
  - {name: metrics, port: 9100, protocol: TCP}
endpoints:
  - addresses: [10.244.1.1]
  - addresses: [10.244.1.2]
    conditions: {ready: false}
---
this: is: not: yaml: [
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-2
  namespace: shop
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports:
  - {name: http, port: 8081, protocol: TCP}
  - {name: metrics, port: 9100, protocol: TCP}
endpoints:
  - addresses: [10.244.2.1]
    conditions: {ready: true}
  - addresses: [10.244.1.1]
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: shop}
---
apiVersion: v1
kind: Service
metadata: {name: bad-ip, namespace: shop}
spec:
  clusterIP: 10.96.0.300
  ports: [{port: 80}]
---
apiVersion: v1
kind: Service
metadata: {name: port-zero, namespace: shop}
spec:
  clusterIP: 10.96.0.11
  ports: [{port: 0}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: big-port
  namespace: shop
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports: [{name: http, port: 70000}]
endpoints: [{addresses: [10.244.9.9]}]
---
apiVersion: v1
kind: Service
metadata: {name: dns, namespace: kube-system}
spec:
  clusterIP: 10.96.0.53
  ports: [{name: dns, port: 53, protocol: UDP, targetPort: 53}]
"#;

fn parse(text: &str) -> Snapshot {
    let mut set = Snapshot::default();
    parse_into(text, "cluster.yaml", &mut set);
    set
}

fn port(ns: &str, name: &str, port: &str, protocol: Protocol) -> ServicePortName {
    ServicePortName {
        service: ObjectName {
            namespace: ns.into(),
            name: name.into(),
        },
        port: port.into(),
        protocol,
        family: crate::model::IpFamily::V4,
    }
}

fn problem_with(set: &Snapshot, needle: &str) -> Problem {
    set.problems
        .iter()
        .find(|p| p.to_string().contains(needle))
        .unwrap_or_else(|| panic!("no problem mentions {needle:?}: {:#?}", set.problems))
        .clone()
}

#[test]
fn one_broken_document_costs_only_itself() {
    let set = parse(MIXED);
    assert_eq!(set.store.services.len(), 2, "web and dns survive");
    assert_eq!(set.store.slices.len(), 2, "web-1 and web-2 survive");

    let yaml = problem_with(&set, "not valid YAML");
    assert!(yaml.origin.contains("cluster.yaml document 3"), "{yaml}");
    let kind = problem_with(&set, "unsupported kind Deployment");
    assert!(kind.to_string().contains("shop/web"), "{kind}");
    assert!(kind.origin.contains("document 5"), "{kind}");
    let ip = problem_with(&set, "10.96.0.300");
    assert!(ip.to_string().contains("Service shop/bad-ip"), "{ip}");
    assert!(ip.to_string().contains("spec.clusterIP"), "{ip}");
    let zero = problem_with(&set, "port-zero");
    assert!(
        zero.to_string()
            .contains("spec.ports[0].port: 0 is not a port number"),
        "{zero}"
    );
    let big = problem_with(&set, "big-port");
    assert!(big.to_string().contains("ports[0].port: 70000"), "{big}");
    assert_eq!(set.problems.len(), 5, "{:#?}", set.problems);
}

#[test]
fn named_and_numeric_target_ports_resolve_per_slice_and_duplicates_merge() {
    let set = parse(MIXED);
    let (state, problems) = DesiredState::build(&set.store, &NodeContext::default());
    assert!(problems.is_empty(), "{problems:#?}");
    let http = &state.ports[&port("shop", "web", "http", Protocol::Tcp)];
    assert_eq!(http.frontend.addr.to_string(), "10.96.0.10");
    assert_eq!(http.frontend.port, 80);
    // web-1 resolves `http` to 8080, web-2 to 8081; 10.244.1.2 is not ready; 10.244.1.1
    // appears in both slices with different ports, so both are distinct backends.
    let want: Vec<SocketAddr> = ["10.244.1.1:8080", "10.244.1.1:8081", "10.244.2.1:8081"]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
    assert_eq!(http.backends, want);
    let metrics = &state.ports[&port("shop", "web", "metrics", Protocol::Tcp)];
    let want: Vec<SocketAddr> = ["10.244.1.1:9100", "10.244.2.1:9100"]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
    assert_eq!(
        metrics.backends, want,
        "the same endpoint twice is one backend"
    );
    let dns = &state.ports[&port("kube-system", "dns", "dns", Protocol::Udp)];
    assert!(dns.backends.is_empty(), "a Service without slices refuses");
}

#[test]
fn lists_and_json_documents_are_read() {
    let json = r#"{"apiVersion":"v1","kind":"List","items":[
        {"apiVersion":"v1","kind":"Service","metadata":{"name":"a","namespace":"x"},
         "spec":{"clusterIP":"10.96.1.1","ports":[{"port":53,"protocol":"UDP"}]}},
        {"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice",
         "metadata":{"name":"a-1","namespace":"x","labels":{"kubernetes.io/service-name":"a"}},
         "addressType":"IPv4","ports":[{"name":"","port":5353,"protocol":"UDP"}],
         "endpoints":[{"addresses":["10.244.0.7"],"conditions":{}}]},
        {"apiVersion":"v1","kind":"Node","metadata":{"name":"node-a","labels":{"topology.kubernetes.io/zone":"z2"}},
         "status":{"addresses":[{"type":"InternalIP","address":"192.0.2.7"}]}}]}"#;
    let set = parse(json);
    assert!(set.problems.is_empty(), "{:#?}", set.problems);
    assert_eq!(set.nodes.len(), 1);
    assert_eq!(
        set.nodes[0].to_string(),
        "node node-a InternalIP=192.0.2.7 zone=z2"
    );
    let (state, _) = DesiredState::build(&set.store, &NodeContext::default());
    let a = &state.ports[&port("x", "a", "", Protocol::Udp)];
    assert_eq!(
        a.backends,
        vec!["10.244.0.7:5353".parse().unwrap()],
        "absent ready = ready"
    );
}

#[test]
fn document_numbers_and_lines_point_at_the_document() {
    let text = "---\n# only a comment\n---\napiVersion: v1\nkind: Service\nmetadata: {name: s}\nspec: {clusterIP: nope, ports: [{port: 1}]}\n";
    let set = parse(text);
    let p = problem_with(&set, "nope");
    assert!(p.origin.contains("document 1 (line 3)"), "{p}");
}

#[test]
fn directory_with_configmap_layout_is_read_through_its_symlinks() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("..2026_11_29_01");
    fs::create_dir(&data).unwrap();
    fs::write(data.join("services.yaml"), MIXED).unwrap();
    fs::write(data.join("notes.txt"), "ignored").unwrap();
    symlink("..2026_11_29_01", dir.path().join("..data")).unwrap();
    symlink("..data/services.yaml", dir.path().join("services.yaml")).unwrap();
    let set = load(dir.path()).unwrap();
    assert_eq!(
        set.store.services.len(),
        2,
        "read once, through the visible symlink"
    );
    assert!(set
        .problems
        .iter()
        .all(|p| p.origin.contains("services.yaml")));
}

#[test]
fn symlink_loops_are_reported_and_read_once() {
    let dir = tempfile::tempdir().unwrap();
    let sub = dir.path().join("team-a");
    fs::create_dir(&sub).unwrap();
    fs::write(sub.join("services.yaml"), MIXED).unwrap();
    symlink("..", sub.join("up")).unwrap();
    symlink(".", dir.path().join("self")).unwrap();
    let set = load(dir.path()).unwrap();
    assert_eq!(set.store.services.len(), 2, "each file read once");
    let loops: Vec<String> = set
        .problems
        .iter()
        .filter(|p| p.message.contains("symlink loop"))
        .map(ToString::to_string)
        .collect();
    assert_eq!(loops.len(), 2, "{:?}", set.problems);
    assert!(loops.iter().any(|l| l.contains("team-a/up")), "{loops:?}");
    assert!(
        set.problems
            .iter()
            .all(|p| !p.message.contains("defined again")),
        "{:?}",
        set.problems
    );
}

#[test]
fn missing_path_is_a_clear_error() {
    let err = load(Path::new("/nonexistent/manifests")).unwrap_err();
    assert!(
        format!("{err:#}").contains("--manifests /nonexistent/manifests"),
        "{err:#}"
    );
}

async fn expect_event(rx: &mut mpsc::Receiver<()>, what: &str) {
    tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .unwrap_or_else(|_| panic!("no reload after {what}"))
        .expect("watcher alive");
    // Drain what the same burst may still send.
    tokio::time::sleep(Duration::from_millis(300)).await;
    while rx.try_recv().is_ok() {}
}

#[tokio::test]
async fn watch_sees_edits_atomic_renames_and_configmap_symlink_swaps() {
    let dir = tempfile::tempdir().unwrap();
    // A single file, replaced by rename as editors and `kubectl cp` do.
    let file = dir.path().join("cluster.yaml");
    fs::write(&file, "").unwrap();
    let (tx, mut rx) = mpsc::channel(1);
    let _w = watch(&file, SETTLE, tx).unwrap();
    fs::write(&file, MIXED).unwrap();
    expect_event(&mut rx, "an in-place write").await;
    let tmp = dir.path().join(".cluster.yaml.tmp");
    fs::write(&tmp, "").unwrap();
    fs::rename(&tmp, &file).unwrap();
    expect_event(&mut rx, "a replace by rename").await;
    assert!(load(&file).unwrap().store.services.is_empty());

    // A ConfigMap volume: files are symlinks through ..data, which is swapped atomically.
    let cm = tempfile::tempdir().unwrap();
    let v1 = cm.path().join("..v1");
    fs::create_dir(&v1).unwrap();
    fs::write(v1.join("cluster.yaml"), "").unwrap();
    symlink("..v1", cm.path().join("..data")).unwrap();
    symlink("..data/cluster.yaml", cm.path().join("cluster.yaml")).unwrap();
    let (tx, mut rx) = mpsc::channel(1);
    let _w2 = watch(cm.path(), SETTLE, tx).unwrap();
    let v2 = cm.path().join("..v2");
    fs::create_dir(&v2).unwrap();
    fs::write(v2.join("cluster.yaml"), MIXED).unwrap();
    symlink("..v2", cm.path().join("..data_tmp")).unwrap();
    fs::rename(cm.path().join("..data_tmp"), cm.path().join("..data")).unwrap();
    fs::remove_dir_all(&v1).unwrap();
    expect_event(&mut rx, "a ConfigMap symlink swap").await;
    assert_eq!(load(cm.path()).unwrap().store.services.len(), 2);
}

#[tokio::test]
async fn watching_a_file_ignores_its_neighbours_and_reads() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cluster.yaml");
    fs::write(&file, MIXED).unwrap();
    let (tx, mut rx) = mpsc::channel(1);
    let _w = watch(&file, SETTLE, tx).unwrap();
    // A log file beside it, written continuously, and reloads reading it: no reload, or the
    // agent would reload forever.
    for i in 0..20 {
        fs::write(dir.path().join("agent.log"), format!("line {i}")).unwrap();
        let _ = load(&file).unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let quiet = tokio::time::timeout(Duration::from_millis(400), rx.recv()).await;
    assert!(
        quiet.is_err(),
        "reloaded for a change that was not to the manifest"
    );
    fs::write(&file, "").unwrap();
    expect_event(&mut rx, "a write to the file").await;
}

/// Names reach iptables and nft scripts (comments, chain names): a name that could end a
/// quoted comment or start a new rule is refused, naming the field, and costs only its own
/// object.
#[test]
fn names_that_could_inject_rule_text_are_refused_with_the_field() {
    let yaml = r#"
apiVersion: v1
kind: Service
metadata: {name: "web\" -j ACCEPT\n-A KUBE-SERVICES", namespace: shop}
spec:
  clusterIP: 10.96.0.30
  ports: [{name: http, port: 80}]
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: "shop\nCOMMIT"}
spec:
  clusterIP: 10.96.0.31
  ports: [{name: http, port: 80}]
---
apiVersion: v1
kind: Service
metadata: {name: ports, namespace: shop}
spec:
  clusterIP: 10.96.0.32
  ports: [{name: "http\" ; flush ruleset", port: 80}]
---
apiVersion: v1
kind: Service
metadata: {name: target, namespace: shop}
spec:
  clusterIP: 10.96.0.33
  ports: [{name: http, port: 80, targetPort: "a b"}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: fine-1
  namespace: shop
  labels: {kubernetes.io/service-name: "x\ny"}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints: [{addresses: [10.244.1.1]}]
---
apiVersion: v1
kind: Service
metadata: {name: fine, namespace: shop}
spec:
  clusterIP: 10.96.0.34
  ports: [{name: http, port: 80}]
"#;
    let set = parse(yaml);
    assert_eq!(
        set.store.services.len(),
        1,
        "only the valid Service is kept"
    );
    for field in [
        "metadata.name: \"web\\\" -j ACCEPT\\n-A KUBE-SERVICES\" is not a DNS-1123 subdomain",
        "metadata.namespace: \"shop\\nCOMMIT\" is not a DNS-1123 label",
        "spec.ports[0].name: \"http\\\" ; flush ruleset\" is not a DNS-1123 label",
        "spec.ports[0].targetPort: \"a b\" is not a DNS-1123 label",
        "metadata.labels[kubernetes.io/service-name]: \"x\\ny\" is not a DNS-1123 subdomain",
    ] {
        problem_with(&set, field);
    }
    assert_eq!(set.problems.len(), 5, "{:#?}", set.problems);
}

fn web(name: &str, ip: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: shop}}\n\
         spec: {{clusterIP: {ip}, ports: [{{port: 80, protocol: TCP}}]}}\n---\n"
    )
}

/// Writes a file and dates its modification a minute back, as a file written before the
/// agent read it is (a stamp from the last second is not trusted: see below).
fn write_old(path: &Path, text: &str) {
    fs::write(path, text).unwrap();
    let minute_ago = std::time::SystemTime::now() - Duration::from_secs(60);
    fs::File::options()
        .write(true)
        .open(path)
        .unwrap()
        .set_modified(minute_ago)
        .unwrap();
}

/// A file rewritten with the same length right after a read may keep its stamp (file times
/// advance in clock ticks): a stamp that recent is not trusted, so the next reload reads it.
#[test]
fn a_same_length_rewrite_right_after_a_read_is_seen() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("s.yaml");
    fs::write(&file, web("x", "10.96.0.1")).unwrap();
    let mut reader = Reader::new(&file);
    reader.load().unwrap();
    fs::write(&file, web("x", "10.96.0.2")).unwrap();
    let set = reader.load().unwrap();
    let (svc, _) = set.store.services.values().next().unwrap();
    assert_eq!(
        svc.cluster_ips,
        ["10.96.0.2".parse::<std::net::IpAddr>().unwrap()]
    );
}

/// A reload reads only the files whose metadata changed and parses only the documents whose
/// text changed; a document that moved keeps its parse and gets its new place as origin.
#[test]
fn a_reload_reads_only_changed_files_and_parses_only_changed_documents() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.yaml"), dir.path().join("b.yaml"));
    write_old(&a, &(web("a1", "10.96.0.1") + &web("a2", "10.96.0.2")));
    write_old(&b, &web("b1", "10.96.1.1"));
    let mut reader = Reader::new(dir.path());
    let first = reader.load().unwrap();
    assert_eq!(first.store.services.len(), 3);
    assert_eq!((reader.files_read, reader.documents_parsed), (2, 3));

    let again = reader.load().unwrap();
    assert_eq!(
        (reader.files_read, reader.documents_parsed),
        (2, 3),
        "nothing changed"
    );
    assert_eq!(again.store.services, first.store.services);

    // A document inserted at the top of a.yaml: a1 and a2 move down, unparsed.
    write_old(
        &a,
        &(web("a0", "10.96.0.9") + &web("a1", "10.96.0.1") + &web("a2", "10.96.0.2")),
    );
    let moved = reader.load().unwrap();
    assert_eq!((reader.files_read, reader.documents_parsed), (3, 4));
    assert_eq!(moved.store.services.len(), 4);
    let a2 = &moved.store.services[&ObjectName {
        namespace: "shop".into(),
        name: "a2".into(),
    }];
    assert!(a2.1.ends_with("a.yaml document 3 (line 10)"), "{}", a2.1);
    assert_eq!(a2.0, first.store.services.values().nth(1).unwrap().0);

    // The periodic re-read reads every file, but parses nothing it has seen.
    reader.forget_files();
    let reread = reader.load().unwrap();
    assert_eq!((reader.files_read, reader.documents_parsed), (5, 4));
    assert_eq!(reread.store.services, moved.store.services);

    fs::remove_file(&b).unwrap();
    assert_eq!(
        reader.load().unwrap().store.services.len(),
        3,
        "b1 went with its file"
    );
}

/// The same name in two documents: the later wins, with a problem naming both places, on a
/// cached reload as on the first.
#[test]
fn a_name_defined_twice_is_reported_on_every_load() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("s.yaml");
    fs::write(&file, web("x", "10.96.0.1") + &web("x", "10.96.0.2")).unwrap();
    let mut reader = Reader::new(&file);
    for _ in 0..2 {
        let set = reader.load().unwrap();
        let p = problem_with(&set, "defined again");
        assert!(p.origin.ends_with("document 2 (line 5)"), "{p}");
        assert!(p.message.contains("document 1 (line 1)"), "{p}");
        let (svc, _) = set.store.services.values().next().unwrap();
        assert_eq!(
            svc.cluster_ips,
            ["10.96.0.2".parse::<std::net::IpAddr>().unwrap()]
        );
    }
    assert_eq!(reader.documents_parsed, 2);
}

/// Documents are slices of the file unless they must be pieced together: an inline
/// `--- {...}` document, a `...` end marker; CRLF files split alike; empty and comment-only
/// documents are dropped.
#[test]
fn documents_split_at_separators_inline_documents_and_end_markers() {
    let text =
        "# header\n---\na: 1\r\nb: 2\r\n--- {c: 3}\nd: 4\n...\n---\n# only a comment\n---\ne: 5";
    let docs = split_documents(text);
    let got: Vec<(usize, &str, bool)> = docs
        .iter()
        .map(|(line, d)| (*line, d.as_ref(), matches!(d, Cow::Borrowed(_))))
        .collect();
    assert_eq!(
        got,
        [
            (2, "a: 1\r\nb: 2\r\n", true),
            (5, "{c: 3}\nd: 4\n", false),
            (10, "e: 5", true),
        ]
    );
}

/// A file of many documents is parsed on several threads, with the same result, in the same
/// order, as one thread gives (what later definitions replace depends on it).
#[test]
fn many_documents_parse_alike_on_several_threads() {
    let mut text = String::new();
    for i in 0..1100 {
        // Every tenth name comes again later: the later definition must win.
        text.push_str(&web(
            &format!("s{}", i % 1000),
            &format!("10.96.{}.{}", i / 250, i % 250),
        ));
    }
    text.push_str("kind: Nonsense\n");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("many.yaml");
    fs::write(&file, &text).unwrap();
    let threads = Reader::new(&file).load().unwrap();
    let mut one = Snapshot::default();
    parse_into(&text, &file.display().to_string(), &mut one);
    assert_eq!(threads.store.services.len(), 1000);
    assert_eq!(threads.store.services, one.store.services);
    assert_eq!(threads.problems, one.problems);
    assert_eq!(
        threads.problems.len(),
        101,
        "100 names defined again, one unknown kind"
    );
}
