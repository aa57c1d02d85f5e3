//! The sync loop's state: a source's updates add up to a [`View`]; the objects each update
//! changed are recomputed into the desired state and a list of changes
//! ([`IncrementalModel`]); the changes are handed to the proxier no more often than
//! minSyncPeriod, with kube-proxy's metrics and health bookkeeping.
//!
//! Which sync runs when:
//! - a change: a partial sync, now or once minSyncPeriod has passed since the last one
//!   ([`SyncLoop::sync_or_defer`]);
//! - every syncPeriod: a partial sync, or a full one when the last full sync is older than
//!   [`FULL_SYNC_PERIOD`] ([`SyncLoop::periodic`]);
//! - after a failed sync: the next one is full, whatever asked for it (the failed sync's
//!   changes are not replayed; a full sync covers them).

use std::{
    collections::HashSet,
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use tracing::{info, warn};

use crate::{
    cli::Settings,
    health::{proxy::ProxyHealth, services as service_health, services::ServiceHealthServers},
    kernel::host::local_addresses,
    metrics::{unix_seconds, Metrics},
    model::{
        explain::Explanation,
        incremental::IncrementalModel,
        local::{DetectLocal, LocalTraffic},
        objects::NodeInfo,
        DesiredState, NodeContext, NodePortAddress, ObjectName, ObjectStore, Problem, ProblemKind,
        Scheduler, ServiceChange, ServicePortName, WhenEmpty,
    },
    proxier::Proxier,
    source::events::{Notice, ServiceEvents},
    source::{Update, View},
};

/// The longest time between full syncs, kube-proxy's `FullSyncPeriod`: a full sync rewrites
/// (or, in eBPF mode, re-reads) the whole datapath, which at 10 000 services takes seconds
/// of CPU in the netfilter modes, so the periodic syncs in between are partial, as
/// kube-proxy's are.
pub const FULL_SYNC_PERIOD: Duration = Duration::from_secs(3600);

/// The problems worth an Event on their Service: what a tenant must fix in it.
fn notices(problems: &[Problem]) -> Vec<Notice> {
    problems
        .iter()
        .filter_map(|p| {
            let reason = match p.kind {
                ProblemKind::FrontendConflict => "FrontendConflict",
                ProblemKind::ExternalIpRefused => "ExternalIPRefused",
                ProblemKind::Invalid => return None,
            };
            Some(Notice {
                service: p.service()?,
                reason,
                note: p.message.clone(),
                node: None,
            })
        })
        .collect()
}

/// The nodes the EndpointSlices name: every agent sees the same, so they agree on which of
/// them post an Event (see [`crate::source::events`]).
fn endpoint_nodes(store: &ObjectStore) -> std::collections::BTreeSet<String> {
    store
        .slices
        .values()
        .flat_map(|(slice, _)| slice.endpoints.iter())
        .filter_map(|e| e.node_name.clone())
        .collect()
}

/// A proxier as the sync loop drives it: the common interface and the mode's own metrics.
pub trait ModeProxier: Proxier {
    /// Updates the mode's own metrics, after a sync.
    fn report(&self, _metrics: &Metrics) {}

    /// Service ports the mode could not program as asked, with why (modes that program
    /// service ports one by one; the others fail a whole sync instead).
    fn unprogrammed(&self) -> Vec<(ServicePortName, String)> {
        Vec::new()
    }
}

/// What the sync loop takes from the settings.
#[derive(Clone, Debug)]
pub struct LoopOptions {
    pub node_name: String,
    pub node_port_addresses: Vec<NodePortAddress>,
    pub masquerade_all: bool,
    pub external_ip_cidrs: Vec<crate::model::Cidr>,
    pub default_scheduler: Scheduler,
    pub min_sync_period: Duration,
    pub full_sync_period: Duration,
    /// `detectLocalMode` with its parameter.
    pub detect_local: DetectLocal,
}

impl From<&Settings> for LoopOptions {
    fn from(s: &Settings) -> Self {
        Self {
            node_name: s.node_name.clone(),
            node_port_addresses: s.node_port_addresses.clone(),
            masquerade_all: s.masquerade_all,
            external_ip_cidrs: s.external_ip_cidrs.clone(),
            default_scheduler: s.scheduler,
            min_sync_period: s.min_sync_period,
            full_sync_period: FULL_SYNC_PERIOD,
            detect_local: s.detect_local.clone(),
        }
    }
}

pub struct SyncLoop {
    options: LoopOptions,
    /// What the source has said so far.
    view: View,
    model: IncrementalModel,
    /// The node context the model was last built with: when it changes, every service port
    /// is recomputed.
    context: Option<NodeContext>,
    /// The source for masqueraded flows: this node's first IPv4 InternalIP.
    pub masquerade_addr: Option<std::net::Ipv4Addr>,
    /// The same for IPv6: this node's first IPv6 InternalIP.
    pub masquerade_addr6: Option<std::net::Ipv6Addr>,
    /// How this node's pods are told apart, resolved with its Node object.
    pub local: LocalTraffic,
    local_told: bool,
    /// This node's Node object, as last seen.
    node: Option<NodeInfo>,
    pending: Vec<ServiceChange>,
    pending_since: Option<SystemTime>,
    /// Problems already logged (each is logged when it appears, not on every update).
    reported: HashSet<String>,
    last_sync: Option<Instant>,
    /// When a full sync last succeeded.
    last_full_sync: Option<Instant>,
    /// The last sync failed: the next one is full.
    needs_full: bool,
    health: ProxyHealth,
    metrics: Arc<Metrics>,
    service_health: ServiceHealthServers,
    /// Problems in Services, posted back as Events (API source only).
    events: Option<ServiceEvents>,
    /// The last sync completed with every service port programmed.
    all_served: bool,
    /// The last sync completed (some service ports may have failed).
    completed: bool,
}

impl SyncLoop {
    pub fn new(options: LoopOptions, health: ProxyHealth, metrics: Arc<Metrics>) -> Self {
        Self {
            options,
            view: View::default(),
            model: IncrementalModel::default(),
            context: None,
            masquerade_addr: None,
            masquerade_addr6: None,
            local: LocalTraffic::default(),
            local_told: false,
            node: None,
            pending: Vec::new(),
            pending_since: None,
            reported: HashSet::new(),
            last_sync: None,
            last_full_sync: None,
            needs_full: false,
            service_health: ServiceHealthServers::new(health.clone(), Some(metrics.clone())),
            events: None,
            all_served: false,
            completed: false,
            health,
            metrics,
        }
    }

    /// The state the proxier was last asked to serve, with what is pending.
    pub fn desired(&self) -> &DesiredState {
        self.model.desired()
    }

    /// Why the model serves `service` as it does on this node (`inspect explain`): the
    /// model's own decisions over what the source has said, with the source's problems
    /// with the Service (a Service it rejected is only there).
    pub fn explain(&self, service: &ObjectName) -> Explanation {
        let mut out = match &self.context {
            Some(context) => self.model.explain(&self.view.store, context, service),
            None => Explanation {
                service: service.to_string(),
                note: Some("the agent has not read the cluster yet".into()),
                ..Explanation::default()
            },
        };
        let from_source = self
            .view
            .problems
            .iter()
            .filter(|p| p.service().as_ref() == Some(service))
            .map(|p| format!("{}: {}", p.origin, p.message));
        let mut problems: Vec<String> = from_source.collect();
        problems.append(&mut out.problems);
        out.problems = problems;
        out
    }

    /// This node's name.
    pub fn node_name(&self) -> &str {
        &self.options.node_name
    }

    /// Changes read but not yet handed to the proxier.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Whether the last sync completed with every service port programmed: the other modes'
    /// leftovers may go then (see `agent::run`).
    pub fn all_served(&self) -> bool {
        self.all_served
    }

    /// Whether the last sync completed, perhaps with some service ports not programmed.
    pub fn completed(&self) -> bool {
        self.completed
    }

    /// Posts the problems the model finds in Services as Events on them (API source).
    pub fn set_events(&mut self, events: ServiceEvents) {
        self.events = Some(events);
    }

    /// Takes in a source's update and queues the changes it makes: the service ports of
    /// the objects it changed are recomputed, or all of them when this node's context
    /// changed (its Node object, its addresses).
    pub fn ingest(&mut self, update: impl Into<Update>) {
        let touched = self.view.apply(update.into());
        let node = self.view.node(&self.options.node_name);
        let context = NodeContext {
            masquerade_all: self.options.masquerade_all,
            external_ip_cidrs: self.options.external_ip_cidrs.clone(),
            default_scheduler: self.options.default_scheduler,
            ..NodeContext::new(
                &self.options.node_name,
                node,
                &self.options.node_port_addresses,
                &local_addresses(),
            )
        };
        let rebuild = self.context.as_ref() != Some(&context);
        let changes = if rebuild {
            let changes = self.model.rebuild(&self.view.store, &context);
            self.context = Some(context);
            changes
        } else if touched.is_empty() {
            Vec::new()
        } else {
            self.model.apply(&self.view.store, &context, &touched)
        };
        let context = self.context.as_ref().expect("set above");
        self.masquerade_addr = context.masquerade_addr;
        self.masquerade_addr6 = context.masquerade_addr6;
        // Problems are walked only when they may have changed: a tenant's many invalid
        // objects must not make every other event cost their number.
        let model_problems_changed = self.model.take_problems_changed();
        if rebuild || model_problems_changed || self.view.problems_updated {
            self.report_problems();
        }
        let node = self.view.node(&self.options.node_name).cloned();
        if node != self.node {
            match &node {
                Some(n) if n.ineligible.is_some() => warn!("{n}: /healthz answers 503"),
                Some(n) => info!("{n}"),
                None => {
                    warn!(node = %self.options.node_name, "this node's Node object is not known")
                }
            }
            self.health
                .set_ineligible(node.as_ref().and_then(|n| n.ineligible.clone()));
            self.node = node;
        }
        self.follow_local_traffic();
        if changes.is_empty() {
            return;
        }
        let now = SystemTime::now();
        self.pending_since.get_or_insert(now);
        self.health.queued(now);
        self.metrics
            .sync_last_queued_timestamp
            .set(unix_seconds(now));
        let endpoints: usize = changes.iter().map(ServiceChange::endpoint_changes).sum();
        self.metrics
            .service_changes_total
            .inc_by(changes.len() as u64);
        self.metrics.endpoint_changes_total.inc_by(endpoints as u64);
        self.pending.extend(changes);
        self.metrics
            .service_changes_pending
            .set(self.pending.len() as i64);
        self.metrics.endpoint_changes_pending.set(
            self.pending
                .iter()
                .map(ServiceChange::endpoint_changes)
                .sum::<usize>() as i64,
        );
    }

    /// Logs the problems that appeared, counts them, and posts Events for new ones in
    /// Services (API source).
    fn report_problems(&mut self) {
        let model_problems = self.model.problems();
        let count = |kind| model_problems.iter().filter(|p| p.kind == kind).count() as i64;
        self.metrics
            .frontend_conflicts
            .set(count(ProblemKind::FrontendConflict));
        self.metrics
            .external_ips_refused
            .set(count(ProblemKind::ExternalIpRefused));
        let mut reported = HashSet::with_capacity(self.reported.len());
        let mut new = Vec::new();
        for p in self.view.problems.iter().chain(&model_problems) {
            let text = p.to_string();
            if !self.reported.contains(&text) {
                warn!("{text}");
                new.push(p.clone());
            }
            reported.insert(text);
        }
        self.reported = reported;
        self.post_notices(&new);
    }

    /// Posts Events for `problems` that are a tenant's to fix (API source). The poster is
    /// chosen among the endpoints' nodes, so they are walked, but only when there is
    /// something to post: for new problems at once, for all of them every syncPeriod (an
    /// Event dropped by the rate limit, or whose poster went away, is posted then).
    fn post_notices(&self, problems: &[Problem]) {
        if let Some(events) = &self.events {
            let notices = notices(problems);
            if !notices.is_empty() {
                events.notice(notices, endpoint_nodes(&self.view.store));
            }
        }
    }

    /// The start-up sync. It writes everything (the eBPF proxier's first sync is complete
    /// though it reports itself as partial), so it counts as full: the periodic full sync
    /// comes [`LoopOptions::full_sync_period`] later.
    pub fn first_sync(&mut self, proxier: &mut dyn ModeProxier) {
        if self.sync(proxier, false) {
            self.last_full_sync = Some(Instant::now());
        }
    }

    /// Syncs now, or returns when to, if the last sync was less than minSyncPeriod ago.
    pub fn sync_or_defer(&mut self, proxier: &mut dyn ModeProxier) -> Option<Instant> {
        if self.pending.is_empty() {
            return None;
        }
        if let Some(last) = self.last_sync {
            let next = last + self.options.min_sync_period;
            if Instant::now() < next {
                return Some(next);
            }
        }
        self.sync(proxier, false);
        None
    }

    /// The syncPeriod tick: partial, or full once the last full sync is old enough.
    pub fn periodic(&mut self, proxier: &mut dyn ModeProxier) {
        let full = self
            .last_full_sync
            .is_none_or(|t| t.elapsed() >= self.options.full_sync_period);
        self.sync(proxier, full);
        self.post_notices(&self.model.problems());
    }

    /// Resolves `detectLocalMode` with the Node object as last seen, logging each change.
    fn follow_local_traffic(&mut self) {
        let mode = &self.options.detect_local;
        let local = mode.resolve(self.node.as_ref());
        if local == self.local && std::mem::replace(&mut self.local_told, true) {
            return;
        }
        match mode {
            DetectLocal::NodeCidr if local.0.iter().all(Option::is_none) => warn!(
                node = %self.options.node_name,
                "detectLocalMode NodeCIDR: the Node has no spec.podCIDRs yet; until it does, no client counts as a pod (cluster-IP traffic is not masqueraded, pods take externalTrafficPolicy: Local as other clients)"
            ),
            DetectLocal::ClusterCidr(c) if c.is_empty() => info!(
                "detectLocalMode ClusterCIDR without a cluster CIDR: no client counts as a pod"
            ),
            _ => info!("detectLocalMode {}: {local}", mode.mode()),
        }
        self.local = local;
    }

    /// One sync (full when asked or when the last one failed); whether it succeeded.
    pub fn sync(&mut self, proxier: &mut dyn ModeProxier, full: bool) -> bool {
        let full = full || self.needs_full;
        let started = Instant::now();
        let changes = std::mem::take(&mut self.pending);
        proxier.set_masquerade_addresses(self.masquerade_addr, self.masquerade_addr6);
        proxier.set_local_traffic(&self.local);
        let result = if full {
            proxier.sync_full(self.model.desired())
        } else {
            // Repeated changes to one service port collapse to old -> newest; the proxier
            // only needs to know which ports changed.
            proxier.sync(self.model.desired(), &changes)
        };
        let elapsed = started.elapsed().as_secs_f64();
        // Programmed now: recorded before the gauges below, so a scrape that sees the new
        // backends also sees the latency of the change that brought them.
        if matches!(&result, Ok(r) if r.services_failed == 0) {
            if let Some(since) = self.pending_since.take() {
                let took = SystemTime::now().duration_since(since).unwrap_or_default();
                self.metrics
                    .network_programming_duration
                    .observe(took.as_secs_f64());
            }
            self.metrics.service_changes_pending.set(0);
            self.metrics.endpoint_changes_pending.set(0);
        }
        self.last_sync = Some(Instant::now());
        self.needs_full = result.is_err();
        self.metrics.sync_duration.observe(elapsed);
        let full = full || result.as_ref().is_ok_and(|r| r.full);
        if full {
            if result.is_ok() {
                self.last_full_sync = Some(Instant::now());
            }
            self.metrics.sync_full_duration.observe(elapsed);
        } else {
            self.metrics.sync_partial_duration.observe(elapsed);
        }
        self.service_health
            .sync(service_health::wanted(self.model.desired()));
        self.count_no_local_endpoints();
        let (ports, backends) = proxier.programmed();
        let mode = proxier.mode().as_str();
        self.metrics
            .programmed_service_ports
            .with_label_values(&[mode])
            .set(ports as i64);
        self.metrics
            .programmed_backends
            .with_label_values(&[mode])
            .set(backends as i64);
        proxier.report(&self.metrics);
        if let Some(events) = &self.events {
            let notices = proxier
                .unprogrammed()
                .into_iter()
                .map(|(name, why)| Notice {
                    service: name.service.clone(),
                    reason: "NotProgrammed",
                    note: format!("port {} ({}): {why}", name.port, name.protocol),
                    // This node's maps: its own problem, posted by itself.
                    node: Some(self.options.node_name.clone()),
                })
                .collect();
            // Node-local notices: the endpoints' nodes play no part.
            events.notice(notices, Default::default());
        }
        // `services_failed` counts every port not programmed as asked.
        self.all_served = matches!(&result, Ok(r) if r.services_failed == 0);
        self.completed = result.is_ok();
        match result {
            Ok(report) => {
                self.metrics
                    .conntrack_deleted_total
                    .inc_by(report.flows_deleted as u64);
                self.metrics
                    .unprogrammed_service_ports
                    .set(report.services_failed as i64);
                for (reason, n) in &report.failure_reasons {
                    self.metrics
                        .sync_failures
                        .with_label_values(&[reason])
                        .inc_by(*n as u64);
                }
                // The sync completed: health follows the loop, not each service port (those
                // that failed are in the metric and the log, and retried).
                let now = SystemTime::now();
                self.health.updated(now);
                self.metrics.sync_last_timestamp.set(unix_seconds(now));
                if !changes.is_empty() || report.services_failed > 0 {
                    info!(
                        full,
                        changes = changes.len(),
                        written = report.services_written,
                        failed = report.services_failed,
                        service_ports = self.model.desired().ports.len(),
                        elapsed_ms = elapsed * 1000.0,
                        "synced"
                    );
                }
                true
            }
            Err(e) => {
                warn!("sync failed (the next sync is full): {e:#}");
                false
            }
        }
    }

    /// Service ports whose Local policy finds endpoints elsewhere but none here.
    fn count_no_local_endpoints(&self) {
        let (mut internal, mut external) = (0, 0);
        for state in self.model.desired().ports.values() {
            internal += (state.when_empty == WhenEmpty::Drop) as i64;
            external += state
                .external
                .iter()
                .any(|f| f.when_empty == WhenEmpty::Drop) as i64;
        }
        for (policy, n) in [("internal", internal), ("external", external)] {
            self.metrics
                .no_local_endpoints
                .with_label_values(&[policy])
                .set(n);
        }
    }
}

#[cfg(test)]
mod tests;
