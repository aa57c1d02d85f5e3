//! The view a source's updates add up to, and what each update is found to change.

use super::*;
use crate::source::manifests::parse_into;

fn snapshot(text: &str) -> Snapshot {
    let mut set = Snapshot::default();
    parse_into(text, "test.yaml", &mut set);
    set
}

fn service(name: &str, ip: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\n\
         spec: {{clusterIP: {ip}, ports: [{{port: 80, protocol: TCP}}]}}\n---\n"
    )
}

fn named(name: &str) -> ObjectName {
    ObjectName {
        namespace: "default".into(),
        name: name.into(),
    }
}

/// A full update names what differs from the last one; a delta names what it changed, not
/// what it merely put again (a relist puts every object).
#[test]
fn updates_name_only_what_they_changed() {
    let mut view = View::default();
    let first = snapshot(&(service("a", "10.96.0.1") + &service("b", "10.96.0.2")));
    let touched = view.apply(first.into());
    assert_eq!(touched.services, [named("a"), named("b")].into());

    let again = snapshot(&(service("a", "10.96.0.1") + &service("c", "10.96.0.3")));
    let touched = view.apply(again.into());
    assert_eq!(
        touched.services,
        [named("b"), named("c")].into(),
        "b gone, c new"
    );

    let a = view.store.services[&named("a")].clone();
    let mut moved = a.clone();
    std::sync::Arc::make_mut(&mut moved.0).cluster_ips = vec!["10.96.0.9".parse().unwrap()];
    let touched = view.apply(Update::Delta(Delta {
        services: vec![
            (named("a"), Some(a)),
            (named("c"), None),
            (named("c"), None),
            (named("d"), None),
        ],
        ..Delta::default()
    }));
    assert_eq!(touched.services, [named("c")].into(), "only c was there");
    assert!(view.store.services.contains_key(&named("a")));
    let touched = view.apply(Update::Delta(Delta {
        services: vec![(named("a"), Some(moved.clone()))],
        problems: Some(vec![]),
        ..Delta::default()
    }));
    assert_eq!(touched.services, [named("a")].into());
    assert_eq!(view.store.services[&named("a")], moved);
}

/// Problems are replaced only by an update that carries them; Nodes follow their puts.
#[test]
fn problems_and_nodes_follow_their_updates() {
    let mut view = View::default();
    let set = snapshot("kind: Nonsense\n---\napiVersion: v1\nkind: Node\nmetadata: {name: n1}\n");
    assert_eq!(set.problems.len(), 1);
    view.apply(set.into());
    assert_eq!(view.problems.len(), 1);
    assert!(view.node("n1").is_some());
    view.apply(Update::Delta(Delta::default()));
    assert_eq!(
        view.problems.len(),
        1,
        "a delta without problems leaves them"
    );
    view.apply(Update::Delta(Delta {
        nodes: vec![("n1".into(), None)],
        problems: Some(vec![]),
        ..Delta::default()
    }));
    assert!(view.problems.is_empty());
    assert!(view.node("n1").is_none());
}
