//! The proxy agent: sources (manifests, later the API server) feed one service model, which
//! drives one proxier per mode.
pub mod attach;
pub mod cgroup;
pub mod cleanup;
pub mod cli;
pub mod config;
pub mod ctnetlink;
pub mod datapath;
pub mod health;
pub mod ipvs_netlink;
pub mod kernel_conntrack;
pub mod local_routes;
pub mod metrics;
pub mod model;
pub mod nlattr;
pub mod pins;
pub mod privileges;
pub mod proxier;
pub mod service_health;
pub mod source;
