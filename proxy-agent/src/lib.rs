//! The proxy agent: sources (manifests, later the API server) feed one service model, which
//! drives one proxier per mode.
pub mod attach;
pub mod datapath;
pub mod model;
pub mod proxier;
pub mod source;
