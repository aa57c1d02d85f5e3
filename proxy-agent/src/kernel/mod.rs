//! The kernel interfaces the proxiers and the agent share: netlink framing, conntrack
//! (flows over ctnetlink, kube-proxy's sysctls), local routes, host facts and privileges,
//! and running the node's tools with a timeout ([`command`]).
pub mod command;
pub mod conntrack;
pub mod host;
pub mod local_routes;
pub mod nlattr;
pub mod privileges;
