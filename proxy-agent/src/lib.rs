//! The proxy agent: sources feed one service model, which drives the proxier of the mode
//! the agent runs. `main.rs` only parses settings and calls [`agent::run`].
//!
//! # Crate map
//! | module | owns |
//! |---|---|
//! | [`agent`] | start-up order and the event loop; the sync loop ([`agent::sync_loop`]); starting a mode and `auto` ([`agent::modes`]); removing other modes' state ([`agent::cleanup`]); logging |
//! | [`cli`], [`config`] | flags; the `--config` file (KubeProxyConfiguration and our fields); precedence into `Settings` |
//! | [`source`] | where objects come from: `--manifests` files ([`source::manifests::Reader`]: only changed files and documents are read again) or the API server, handed over as [`source::Update`]s (a whole [`source::Snapshot`] or a [`source::Delta`]) |
//! | [`model`] | one decision per semantic: validated objects, the desired state per service port, changes, stale flows |
//! | [`proxier`] | the [`proxier::Proxier`] trait and one proxier per mode (ebpf, iptables, nftables, ipvs, userspace) |
//! | [`datapath`] | the eBPF datapath's life cycle: loading, pins, tc attach, cgroup hooks, removal, its runtime |
//! | [`kernel`] | kernel interfaces shared by modes: netlink framing, conntrack flows and sysctls, local routes, host facts, privileges |
//! | [`health`] | `/healthz` and `/livez` ([`health::proxy`]); health-check node ports ([`health::services`]); the bounds every HTTP server runs within ([`health::http`]) |
//! | [`metrics`] | every Prometheus metric |
//! | [`inspect`] | `proxy-agent inspect`: the command, its table output, and the agent's loopback endpoint it asks ([`inspect::server`]) |
//! | [`fuzz`] | the fuzzers' entry points: one per input a tenant or the kernel hands the agent |
//!
//! # Where is X
//! | what | where |
//! |---|---|
//! | a Service change, to a map write | [`source`] (an [`source::Update`]) → [`agent::sync_loop::SyncLoop::ingest`] ([`source::View::apply`] names the objects changed) → [`model::incremental::IncrementalModel::apply`] → [`agent::sync_loop::SyncLoop::sync`] → [`proxier::Proxier::sync`] → [`proxier::ebpf::sync::MapSync`] → [`proxier::ebpf::maps::ServiceMaps`] ([`proxier::ebpf::maps::KernelMaps`] in production) |
//! | which endpoints serve, affinity, traffic policy | [`model`] (`ServicePortState`: decided once for every mode) |
//! | which clients are the node's pods (`detectLocalMode`: cluster-IP masquerade, the short-circuit) | [`model::local`] decides; [`agent::sync_loop::SyncLoop`] resolves it with the Node and hands it to [`proxier::Proxier::set_local_traffic`] and [`datapath::runtime::EbpfRuntime::follow_local_traffic`] |
//! | who owns a frontend two Services claim; `--external-ip-cidrs` | [`model::ownership`]; the Events telling the losing Service: [`source::events`] |
//! | NodePort | eBPF: the classifier's service lookup in `proxy-ebpf/src/main.rs` on `SERVICES` entries written per node address ([`model::NodeContext`]); iptables: `KUBE-NODEPORTS` ([`proxier::iptables::rules`]); nftables: the `service-nodeports` map ([`proxier::nftables::rules`]); ipvs: one virtual server per node address ([`proxier::ipvs`]); userspace: a listener per node port ([`proxier::userspace`]) |
//! | refusal (no endpoints) | eBPF: `proxy-ebpf/src/refuse.rs` (TCP reset, ICMP); iptables and nftables: REJECT rules; ipvs: the refusal ipset rules; userspace: not listening. Decided in [`model::WhenEmpty`] |
//! | ClientIP affinity | [`model`] (timeout); eBPF: the `AFFINITY` map in `proxy-ebpf`; iptables: `recent`; nftables: per-endpoint sets; ipvs: persistence; userspace: [`proxier::userspace`] balancer |
//! | the socket hooks | [`datapath::cgroup`] attaches `proxy-ebpf`'s connect/sendmsg/recvmsg/getpeername/release programs (`proxy-ebpf/src/sock.rs` decides); `--socket-lb` |
//! | what the kernel's BPF offers (probed once, logged) | [`datapath::features`] |
//! | restarts: adopting pinned maps; reusing the same build's verified programs | [`datapath::pins`]; [`datapath::reuse`] |
//! | batch map writes (the sync) and reads (the conntrack sweep), which aya lacks | [`datapath::batch`] |
//! | nftables over netlink; its tables of 1 000 service ports | [`proxier::nftables::netlink`] (`encode_script`); `table_of`, [`proxier::nftables::SERVICES_PER_TABLE`] |
//! | iptables-nft full syncs in chunks | `RuleTables::chunked_full_syncs` in [`proxier::iptables::tables`]; `write_family` in [`proxier::iptables`] |
//! | stale conntrack flows | [`model::stale_flows`] decides; [`kernel::conntrack::flows`] deletes over ctnetlink |
//! | cleanup and mode switches | [`agent::cleanup::remove_modes`]; the eBPF part in [`datapath::cleanup`] |
//! | eBPF conntrack entries (both families), evictions, flood safety (`CT_NEW`, confirmation) | `proxy-ebpf/src/conntrack.rs` (`track`, `forget`, `touch`, `confirm`, `may_open`); the sweep and eviction counts in [`datapath::runtime`] |
//! | mode selection (`auto`) | [`agent::modes::choose`] |
//! | health-check node ports | [`health::services`] |
//! | where a Service's traffic goes, with counters (`inspect services`) | [`inspect::services`] (the view, conntrack counting); the modes' counters: `ActiveProxier::counted` in [`agent::modes`]; with the eBPF agent stopped: [`inspect::pinned`], named by `SERVICE_NAMES` (written by `EbpfProxier::write_names` in [`proxier::ebpf`]) |
//! | the flows through services (`inspect conntrack`) | [`inspect::conntrack`]: the eBPF conntrack pins, kernel conntrack ([`kernel::conntrack::flows`]), the userspace relays (`ActiveProxier::relayed_flows` in [`agent::modes`]) |
//! | what a new flow would get, without sending one (`inspect trace`) | [`inspect::trace`] over the desired state; the datapath's affinity and flows added by [`inspect::server`] |
//! | why an endpoint is or is not used (`inspect explain`) | [`model::explain`], recorded by `build_port` as it decides; asked through [`inspect::server`] → [`agent::sync_loop::SyncLoop::explain`] → [`model::incremental::IncrementalModel::explain`] |
//! | HTTP timeouts, header size, connection cap (slow clients) | [`health::http`] |
//! | a tuple two flows would share at the backend (tuple clash) | `reply_taken` in `proxy-ebpf/src/conntrack.rs` |
//! | fuzz targets, corpus, soak | [`fuzz`]; `tests/fuzz` (`cargo xtask fuzz`); `tests/tests/packet_fuzz.rs` (the eBPF programs); `tests/src/bin/soak.rs` (`cargo xtask soak`) |
//!
//! The same table, with the docs' view of it, is in `docs/architecture.md`.
pub mod agent;
pub mod cli;
pub mod config;
pub mod datapath;
pub mod fuzz;
pub mod health;
pub mod inspect;
pub mod kernel;
pub mod metrics;
pub mod model;
pub mod proxier;
pub mod source;
