//! Sources of Services and EndpointSlices.
pub mod api;
pub mod manifests;
