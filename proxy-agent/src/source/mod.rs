//! Sources of Services, EndpointSlices and Nodes: manifest files ([`manifests`]) or the API
//! server ([`api`]). A source sends [`Update`]s: the manifest source a whole [`Snapshot`]
//! after each reload, the API source a [`Delta`] per watch event (a relist too is a delta,
//! of every object it listed). The sync loop keeps the sum in a [`View`], which names the
//! objects each update really changed, so the model recomputes only those. With the API
//! server, the problems the model finds in a Service go back to it as Events ([`events`]).
pub mod api;
pub mod events;
pub mod manifests;

use std::collections::BTreeMap;

use crate::model::{
    incremental::Touched, objects::NodeInfo, ObjectName, ObjectStore, Origin, Problem, ServiceInfo,
    SliceInfo,
};

/// One view of the cluster from a source: the objects that passed validation, the problems
/// with the rest (each naming its object and field), and the Nodes seen (the agent picks
/// its own by name).
#[derive(Debug, Default)]
pub struct Snapshot {
    pub store: ObjectStore,
    pub problems: Vec<Problem>,
    pub nodes: Vec<NodeInfo>,
}

/// Objects put (`Some`) or removed (`None`) by name, in the order they happened.
pub type Puts<T> = Vec<(ObjectName, Option<T>)>;

/// What changed since a source's last update.
#[derive(Debug, Default)]
pub struct Delta {
    pub services: Puts<(ServiceInfo, Origin)>,
    pub slices: Puts<(SliceInfo, Origin)>,
    /// Nodes put or removed, by name.
    pub nodes: Vec<(String, Option<NodeInfo>)>,
    /// Every problem the source knows of, when they changed (they are few: one per invalid
    /// object, and an invalid object is not stored).
    pub problems: Option<Vec<Problem>>,
}

/// What a source sends.
#[derive(Debug)]
pub enum Update {
    /// Everything the source knows; replaces the view.
    Full(Snapshot),
    Delta(Delta),
}

impl From<Snapshot> for Update {
    fn from(set: Snapshot) -> Self {
        Update::Full(set)
    }
}

/// Everything a source has said so far, added up.
#[derive(Debug, Default)]
pub struct View {
    pub store: ObjectStore,
    pub problems: Vec<Problem>,
    /// By name; the first definition of a name wins, as the sync loop has always read them.
    pub nodes: BTreeMap<String, NodeInfo>,
}

impl View {
    /// Takes in an update; returns the Services and EndpointSlices whose stored object it
    /// changed (an object put again unchanged, as a relist puts most, is not among them).
    pub fn apply(&mut self, update: Update) -> Touched {
        match update {
            Update::Full(set) => {
                let touched = Touched::between(&self.store, &set.store);
                self.store = set.store;
                self.problems = set.problems;
                self.nodes.clear();
                for node in set.nodes {
                    self.nodes.entry(node.name.clone()).or_insert(node);
                }
                touched
            }
            Update::Delta(delta) => {
                let mut touched = Touched::default();
                for (name, object) in delta.services {
                    if put(&mut self.store.services, &name, object) {
                        touched.services.insert(name);
                    }
                }
                for (name, object) in delta.slices {
                    if put(&mut self.store.slices, &name, object) {
                        touched.slices.insert(name);
                    }
                }
                for (name, node) in delta.nodes {
                    match node {
                        Some(node) => self.nodes.insert(name, node),
                        None => self.nodes.remove(&name),
                    };
                }
                if let Some(problems) = delta.problems {
                    self.problems = problems;
                }
                touched
            }
        }
    }

    /// The Node called `name`, if known.
    pub fn node(&self, name: &str) -> Option<&NodeInfo> {
        self.nodes.get(name)
    }
}

/// Puts or removes one object; whether the map changed.
fn put<T: PartialEq>(
    map: &mut BTreeMap<ObjectName, T>,
    name: &ObjectName,
    object: Option<T>,
) -> bool {
    match object {
        Some(new) => match map.get_mut(name) {
            Some(old) if *old == new => false,
            Some(old) => {
                *old = new;
                true
            }
            None => {
                map.insert(name.clone(), new);
                true
            }
        },
        None => map.remove(name).is_some(),
    }
}

#[cfg(test)]
mod tests;
