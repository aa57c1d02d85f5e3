//! Sources of Services, EndpointSlices and Nodes: manifest files ([`manifests`]) or the API
//! server ([`api`]). Each hands the agent whole [`Snapshot`]s; the model diffs them. With
//! the API server, the problems the model finds in a Service go back to it as Events
//! ([`events`]).
pub mod api;
pub mod events;
pub mod manifests;

use crate::model::{objects::NodeInfo, ObjectStore, Problem};

/// One view of the cluster from a source: the objects that passed validation, the problems
/// with the rest (each naming its object and field), and the Nodes seen (the agent picks
/// its own by name).
#[derive(Debug, Default)]
pub struct Snapshot {
    pub store: ObjectStore,
    pub problems: Vec<Problem>,
    pub nodes: Vec<NodeInfo>,
}
