//! Health: the agent's own ([`proxy`]: `/healthz`, `/livez`, and the servers that also carry
//! `/metrics` and `/proxyMode`) and the per-Service health-check node ports ([`services`]),
//! all served within the bounds of [`http`] (timeouts, header size, connection cap).
pub mod http;
pub mod proxy;
pub mod services;
