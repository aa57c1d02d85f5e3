//! The kernel's connection tracking: [`flows`] deletes stale entries over ctnetlink (the
//! netfilter and ipvs modes), [`sysctls`] applies kube-proxy's `conntrack` tuning.
pub mod flows;
pub mod sysctls;
