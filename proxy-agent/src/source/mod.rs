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
    incremental::{Difference, Touched},
    objects::NodeInfo,
    ObjectName, ObjectStore, Problem, ServiceInfo, SliceInfo, Stored,
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
    pub services: Puts<Stored<ServiceInfo>>,
    pub slices: Puts<Stored<SliceInfo>>,
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
    /// The last update carried the source's problems (they may have changed).
    pub problems_updated: bool,
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
                self.problems_updated = true;
                self.nodes.clear();
                for node in set.nodes {
                    self.nodes.entry(node.name.clone()).or_insert(node);
                }
                touched
            }
            Update::Delta(delta) => {
                let mut touched = Touched::default();
                for (name, object) in delta.services {
                    match put(&mut self.store.services, &name, object) {
                        Difference::None => {}
                        Difference::Moved => drop(touched.moved.insert(name)),
                        Difference::Changed => drop(touched.services.insert(name)),
                    }
                }
                for (name, object) in delta.slices {
                    match put(&mut self.store.slices, &name, object) {
                        Difference::None => {}
                        Difference::Moved => drop(touched.moved_slices.insert(name)),
                        Difference::Changed => drop(touched.slices.insert(name)),
                    }
                }
                for (name, node) in delta.nodes {
                    match node {
                        Some(node) => self.nodes.insert(name, node),
                        None => self.nodes.remove(&name),
                    };
                }
                self.problems_updated = delta.problems.is_some();
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

/// Puts or removes one object; how the map changed.
fn put<T: Eq>(
    map: &mut BTreeMap<ObjectName, Stored<T>>,
    name: &ObjectName,
    object: Option<Stored<T>>,
) -> Difference {
    match object {
        Some(new) => match map.get_mut(name) {
            Some(old) => {
                let difference = Difference::of(old, &new);
                if difference != Difference::None {
                    *old = new;
                }
                difference
            }
            None => {
                map.insert(name.clone(), new);
                Difference::Changed
            }
        },
        None if map.remove(name).is_some() => Difference::Changed,
        None => Difference::None,
    }
}

#[cfg(test)]
mod tests;
