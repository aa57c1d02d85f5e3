//! The desired state kept up to date one Service at a time, as kube-proxy's change
//! trackers do: an event recomputes the service ports of the objects it touched, not the
//! cluster's.
//!
//! What an object touches: a Service, its own service ports; an EndpointSlice, its
//! Service's (before and after, should it move). Ownership of frontends ([`ownership`]) ties
//! Services together: a Service that claims a frontend another also claims may win or lose
//! it when either changes, so the recomputed set is closed over shared frontends (usually
//! it is the one Service: conflicts are rare). Within that set owners are decided exactly
//! as a full build decides them, because every claimant of each of its frontends is in it.
//! A change of the node's own context (its addresses, `masqueradeAll`, ...) touches every
//! service port: [`IncrementalModel::rebuild`]. The property test in `tests.rs` holds the
//! result equal to [`DesiredState::build`] after random event sequences.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::{
    build_port, diff, explain, ownership, DesiredState, Frontend, NodeContext, ObjectName,
    ObjectStore, Problem, ServiceChange, ServicePortName, Stored,
};

/// The objects an event added, changed or removed, by name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Touched {
    pub services: BTreeSet<ObjectName>,
    pub slices: BTreeSet<ObjectName>,
    /// Objects whose only change is their origin (a manifest document that moved down its
    /// file): what they serve is the same, only the problems found in them cite it, so
    /// their Services are recomputed only when they have problems.
    pub moved: BTreeSet<ObjectName>,
    pub moved_slices: BTreeSet<ObjectName>,
}

impl Touched {
    /// The objects that differ between two stores, for sources that re-read everything:
    /// one walk of both, comparing objects, far cheaper than building their service ports.
    pub fn between(old: &ObjectStore, new: &ObjectStore) -> Touched {
        let mut touched = Touched::default();
        differing(
            &old.services,
            &new.services,
            &mut touched.services,
            &mut touched.moved,
        );
        differing(
            &old.slices,
            &new.slices,
            &mut touched.slices,
            &mut touched.moved_slices,
        );
        touched
    }

    pub fn is_empty(&self) -> bool {
        self.services.is_empty()
            && self.slices.is_empty()
            && self.moved.is_empty()
            && self.moved_slices.is_empty()
    }
}

/// How an object put over another differs from it.
#[derive(Debug, PartialEq, Eq)]
pub enum Difference {
    None,
    /// Only its origin.
    Moved,
    Changed,
}

impl Difference {
    /// Objects shared by the two stores compare by pointer first (`Arc`'s `Eq`).
    pub fn of<T: Eq>(old: &Stored<T>, new: &Stored<T>) -> Difference {
        if old.0 != new.0 {
            Difference::Changed
        } else if old.1 != new.1 {
            Difference::Moved
        } else {
            Difference::None
        }
    }
}

/// Sorts the keys present in one map only, or with different objects, into `changed`, and
/// those whose objects differ only in origin into `moved`.
fn differing<T: Eq>(
    old: &BTreeMap<ObjectName, Stored<T>>,
    new: &BTreeMap<ObjectName, Stored<T>>,
    changed: &mut BTreeSet<ObjectName>,
    moved: &mut BTreeSet<ObjectName>,
) {
    for (name, value) in new {
        match old.get(name).map(|o| Difference::of(o, value)) {
            Some(Difference::None) => {}
            Some(Difference::Moved) => {
                moved.insert(name.clone());
            }
            Some(Difference::Changed) | None => {
                changed.insert(name.clone());
            }
        }
    }
    changed.extend(old.keys().filter(|name| !new.contains_key(*name)).cloned());
}

/// What one Service contributed at its last recomputation.
#[derive(Debug, Default)]
struct Built {
    ports: Vec<ServicePortName>,
    /// Every frontend its service ports claimed (won or not).
    frontends: Few<Frontend>,
}

/// A set that is nearly always one or two long (a frontend's claimants, a Service's
/// frontends): a sorted `Vec`, a fraction of a `BTreeSet`'s memory at 100 000 of them.
/// Only ever filled in order (an insert is a push) or sorted once: a tenant may make one
/// long (N Services claiming one external IP), and an insert in the middle would cost N.
#[derive(Clone, Debug)]
struct Few<T>(Vec<T>);

impl<T> Default for Few<T> {
    fn default() -> Self {
        Few(Vec::new())
    }
}

impl<T: Ord> Few<T> {
    fn insert(&mut self, value: T) {
        if let Err(at) = self.0.binary_search(&value) {
            self.0.insert(at, value);
        }
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn iter(&self) -> std::slice::Iter<'_, T> {
        self.0.iter()
    }
}

impl<'a, T> IntoIterator for &'a Few<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

/// The desired state with the indexes that let an event recompute only what it touches.
#[derive(Debug, Default)]
pub struct IncrementalModel {
    desired: DesiredState,
    services: BTreeMap<ObjectName, Built>,
    /// Frontend → the Services whose service ports claim it.
    claimants: HashMap<Frontend, Few<ObjectName>>,
    /// Service → its EndpointSlices, in name order (the order a full build reads them in).
    slices: HashMap<ObjectName, BTreeSet<ObjectName>>,
    /// EndpointSlice → the Service it was last seen with.
    slice_service: HashMap<ObjectName, ObjectName>,
    /// Problems found in each Service's service ports (only Services that have some).
    problems: BTreeMap<ObjectName, Vec<Problem>>,
    /// The problems changed since [`IncrementalModel::take_problems_changed`] last said so.
    problems_changed: bool,
}

impl IncrementalModel {
    pub fn desired(&self) -> &DesiredState {
        &self.desired
    }

    /// The problems of the current state, in the order a full build reports them.
    pub fn problems(&self) -> Vec<Problem> {
        self.problems.values().flatten().cloned().collect()
    }

    /// Whether the problems changed since the last call (the first call: whether there are
    /// any); lets a caller skip walking them after an event that changed none.
    pub fn take_problems_changed(&mut self) -> bool {
        std::mem::take(&mut self.problems_changed)
    }

    /// Recomputes everything (the first view, or a change of the node's context); returns
    /// the changes from the previous state.
    pub fn rebuild(&mut self, store: &ObjectStore, node: &NodeContext) -> Vec<ServiceChange> {
        let old = std::mem::take(&mut self.desired);
        *self = IncrementalModel::default();
        for (name, (slice, _)) in &store.slices {
            self.index_slice(name, &slice.service);
        }
        let all: BTreeSet<ObjectName> = store.services.keys().cloned().collect();
        self.recompute(store, node, &all);
        self.problems_changed = true;
        diff(&old, &self.desired)
    }

    /// Recomputes what `touched` affects in `store` (the store after the event); returns the
    /// changes. `node` must be the context of the last [`IncrementalModel::rebuild`].
    pub fn apply(
        &mut self,
        store: &ObjectStore,
        node: &NodeContext,
        touched: &Touched,
    ) -> Vec<ServiceChange> {
        let mut seeds = touched.services.clone();
        // Moved objects matter only to the problems that cite them.
        seeds.extend(
            touched
                .moved
                .iter()
                .filter(|s| self.problems.contains_key(*s))
                .cloned(),
        );
        seeds.extend(
            touched
                .moved_slices
                .iter()
                .filter_map(|s| self.slice_service.get(s))
                .filter(|s| self.problems.contains_key(*s))
                .cloned(),
        );
        for name in &touched.slices {
            if let Some(old) = self.slice_service.remove(name) {
                if let Some(set) = self.slices.get_mut(&old) {
                    set.remove(name);
                    if set.is_empty() {
                        self.slices.remove(&old);
                    }
                }
                seeds.insert(old);
            }
            if let Some((slice, _)) = store.slices.get(name) {
                self.index_slice(name, &slice.service);
                seeds.insert(slice.service.clone());
            }
        }
        let affected = self.closure(store, node, seeds);
        self.recompute(store, node, &affected)
    }

    fn index_slice(&mut self, slice: &ObjectName, service: &ObjectName) {
        self.slice_service.insert(slice.clone(), service.clone());
        self.slices
            .entry(service.clone())
            .or_default()
            .insert(slice.clone());
    }

    /// Why `service`'s ports serve what they serve on this node, decided as
    /// [`IncrementalModel::apply`] would decide them now (the same closure over shared
    /// frontends, the same build), with the decisions recorded ([`explain`]). `store` and
    /// `node` must be what the model was last brought up to date with. Costs what an
    /// update of the Service costs.
    pub fn explain(
        &self,
        store: &ObjectStore,
        node: &NodeContext,
        service: &ObjectName,
    ) -> explain::Explanation {
        let affected = self.closure(store, node, BTreeSet::from([service.clone()]));
        let mut claims = Vec::new();
        for name in &affected {
            if let Some((svc, origin)) = store.services.get(name) {
                ownership::claims_of(svc, origin, node, &mut claims);
            }
        }
        let slices: Vec<_> = self
            .slices
            .get(service)
            .into_iter()
            .flatten()
            .filter_map(|s| store.slices.get(s))
            .collect();
        let svc = store.services.get(service).map(|(svc, _)| &**svc);
        explain::explain(service, svc, node, claims, &slices)
    }

    /// `seeds` and every Service that shares a claimed frontend with one in the set, before
    /// or after the event.
    fn closure(
        &self,
        store: &ObjectStore,
        node: &NodeContext,
        seeds: BTreeSet<ObjectName>,
    ) -> BTreeSet<ObjectName> {
        // A name joins `affected` when it is queued, so N Services sharing one frontend
        // cost N, not N² (a tenant can make them).
        let mut queue: Vec<ObjectName> = seeds.iter().cloned().collect();
        let mut affected = seeds;
        while let Some(name) = queue.pop() {
            let mut frontends: BTreeSet<Frontend> = self
                .services
                .get(&name)
                .map(|b| b.frontends.iter().copied().collect())
                .unwrap_or_default();
            if let Some((svc, origin)) = store.services.get(&name) {
                let mut claims = Vec::new();
                ownership::claims_of(svc, origin, node, &mut claims);
                frontends.extend(
                    claims
                        .iter()
                        .flat_map(|c| c.requests.iter().map(|r| r.frontend)),
                );
            }
            for frontend in &frontends {
                for other in self.claimants.get(frontend).into_iter().flatten() {
                    if !affected.contains(other) {
                        affected.insert(other.clone());
                        queue.push(other.clone());
                    }
                }
            }
        }
        affected
    }

    /// Rebuilds the service ports of `affected` (closed over shared frontends).
    fn recompute(
        &mut self,
        store: &ObjectStore,
        node: &NodeContext,
        affected: &BTreeSet<ObjectName>,
    ) -> Vec<ServiceChange> {
        let mut old_ports = BTreeMap::new();
        let mut old_frontends = BTreeSet::new();
        let mut old_problems = BTreeMap::new();
        for name in affected {
            if let Some(old) = self.problems.remove(name) {
                old_problems.insert(name, old);
            }
            let Some(built) = self.services.remove(name) else {
                continue;
            };
            old_frontends.extend(built.frontends.iter().copied());
            for port in built.ports {
                if let Some(state) = self.desired.ports.remove(&port) {
                    old_ports.insert(port, state);
                }
            }
        }

        // Once per frontend, not per claimant: all of them are in `affected` (the closure),
        // but a retain keeps any that were not.
        for frontend in &old_frontends {
            if let Some(set) = self.claimants.get_mut(frontend) {
                set.0.retain(|n| !affected.contains(n));
                if set.is_empty() {
                    self.claimants.remove(frontend);
                }
            }
        }

        let mut claims = Vec::new();
        for name in affected {
            if let Some((svc, origin)) = store.services.get(name) {
                ownership::claims_of(svc, origin, node, &mut claims);
            }
        }
        let owners = ownership::Owners::decide(&claims);
        let mut new_ports = BTreeMap::new();
        for claim in claims {
            let service = claim.svc.name.clone();
            let slices: Vec<_> = self
                .slices
                .get(&service)
                .into_iter()
                .flatten()
                .filter_map(|s| store.slices.get(s))
                .collect();
            let built = self.services.entry(service.clone()).or_default();
            // Sorted once below: ports list their frontends in no particular order.
            built
                .frontends
                .0
                .extend(claim.requests.iter().map(|r| r.frontend));
            let port = claim.name.clone();
            let mut problems = Vec::new();
            if let Some(state) = build_port(claim, &owners, &slices, node, &mut problems, None) {
                built.ports.push(port.clone());
                new_ports.insert(port, state);
            }
            if !problems.is_empty() {
                self.problems.entry(service).or_default().extend(problems);
            }
        }
        for name in affected {
            if let Some(built) = self.services.get_mut(name) {
                built.frontends.0.sort_unstable();
                built.frontends.0.dedup();
                for frontend in &built.frontends {
                    self.claimants
                        .entry(*frontend)
                        .or_default()
                        .insert(name.clone());
                }
            }
        }

        self.problems_changed |= affected
            .iter()
            .any(|name| old_problems.get(name) != self.problems.get(name));

        // As `diff` orders them: changed and added ports by name, then removed ones.
        let mut changes = Vec::new();
        for (name, new) in &new_ports {
            match old_ports.get(name) {
                None => changes.push(ServiceChange::Added(new.clone())),
                Some(old) if old != new => changes.push(ServiceChange::Updated {
                    old: old.clone(),
                    new: new.clone(),
                }),
                Some(_) => {}
            }
        }
        for (name, old) in &old_ports {
            if !new_ports.contains_key(name) {
                changes.push(ServiceChange::Removed(old.clone()));
            }
        }
        self.desired.ports.extend(new_ports);
        changes
    }
}

#[cfg(test)]
mod tests;
