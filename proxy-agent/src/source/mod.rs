//! Sources of Services and EndpointSlices.
pub mod manifests;
