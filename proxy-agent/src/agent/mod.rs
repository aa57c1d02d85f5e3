//! The agent process: start-up order and the event loop.
//!
//! Start-up, in this order (each step fails before the node is touched where it can):
//! 1. capabilities for the mode; the bpffs root locked (one agent per root, see
//!    [`crate::datapath::owner`]); `--cleanup` removes every mode's state and stops here;
//! 2. `auto` resolved to a mode ([`modes::choose`]); kernel conntrack tuned, open-files
//!    limit raised;
//! 3. the source (manifest watch or API-server watchers) — a missing API server or path
//!    fails here; the first read or list starts and runs on while
//! 4. the mode's proxier starts ([`modes::start`]; eBPF: the datapath loaded or adopted);
//! 5. the health and metrics servers, and the loopback inspect endpoint;
//! 6. the first view of the cluster, the first sync, and only once this mode serves its service ports
//!    the other modes' leftovers removed ([`cleanup::remove_modes`], when: `Leftovers`), so
//!    a mode switch by restart leaves no gap and a port eBPF cannot program stays served;
//! 7. the event loop: the source's updates → [`sync_loop::SyncLoop`], periodic syncs, and the eBPF
//!    mode's interface events, conntrack sweeps and counters, until SIGTERM.

pub mod cleanup;
pub mod logging;
pub mod modes;
pub mod sync_loop;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use tokio::{signal::unix::SignalKind, sync::mpsc};
use tracing::{debug, info, warn};

use crate::{
    cli::Settings,
    datapath::{owner::RootLock, pins::BpffsRoot},
    health::proxy::{self as health, ProxyHealth},
    inspect,
    kernel::{
        conntrack::sysctls::{self, Outcome},
        host,
        privileges::{self, Capabilities},
    },
    metrics::Metrics,
    proxier::ProxyMode,
    source::{api, manifests},
};
use sync_loop::{LoopOptions, SyncLoop};

/// What the other modes (ours or upstream kube-proxy's) left on the node, and when it goes:
/// once no service port the new mode serves can still reach it, and no sooner than the
/// new mode serves what it can (so a switch by restart leaves no gap).
///
/// * eBPF translates at tc ingress and at connect time, before netfilter, IPVS or a local
///   route sees the packet: the old state catches only the service ports eBPF does not
///   serve, a per-port handover in effect. It goes once eBPF serves every port, so a
///   Service eBPF cannot program (a full map, say) stays served meanwhile; the log says
///   which ports hold it back.
/// * iptables, nftables and ipvs program all or nothing: their first completed sync
///   serves every port.
/// * userspace sees a packet after the old mode's DNAT (and the eBPF mode's tc), so the
///   old state would shadow the ports it serves with stale endpoints: it goes after the
///   first completed sync, and the ports userspace could not open are reported (log,
///   `proxy_agent_unprogrammed_service_ports`).
#[derive(Default)]
struct Leftovers {
    removed: bool,
    reported: bool,
}

impl Leftovers {
    /// Whether the old modes' state may go now.
    fn may_go(mode: ProxyMode, syncs: &SyncLoop) -> bool {
        match mode {
            ProxyMode::Ebpf => syncs.all_served(),
            _ => syncs.completed(),
        }
    }

    /// Removes what other modes left on the node once this mode serves; true when it just did.
    async fn take_over(
        &mut self,
        syncs: &SyncLoop,
        s: &Settings,
        lock: Option<&RootLock>,
        metrics: &Metrics,
    ) -> bool {
        if self.removed {
            return false;
        }
        let may_go = Self::may_go(s.mode, syncs);
        metrics.other_modes_state_kept.set(i64::from(!may_go));
        if !may_go {
            if !self.reported {
                let until = if s.mode == ProxyMode::Ebpf {
                    "serves every service port (see the sync log)"
                } else {
                    "completes a sync"
                };
                warn!(
                    "other proxy modes' state kept on the node until {} {until}; `--cleanup` removes it",
                    s.mode
                );
                self.reported = true;
            }
            return false;
        }
        // Best effort: each failure is logged.
        let _ = cleanup::remove_modes(Some(s.mode), s).await;
        if s.mode != ProxyMode::Ebpf {
            // The eBPF mode's pins are gone: so goes the root this agent locked to remove
            // them (an eBPF agent started later makes a new one and locks that).
            if let Some(lock) = lock {
                lock.remove_record();
            }
        }
        if self.reported {
            info!(
                "{} serves its service ports: other proxy modes' state removed",
                s.mode
            );
        }
        self.removed = true;
        true
    }
}

/// One agent per bpffs root ([`RootLock`]). The eBPF mode and `--cleanup` (`uses_bpffs`)
/// take it, mounting the root if needed; the other modes write no pins but remove the eBPF
/// mode's at a switch, so they take it when the root exists.
fn lock_root(s: &Settings, uses_bpffs: bool) -> Result<Option<RootLock>> {
    if uses_bpffs {
        let root = BpffsRoot::prepare(&s.bpffs_root)?;
        return RootLock::acquire(&root.path).map(Some);
    }
    if s.bpffs_root.is_dir() {
        return RootLock::acquire(&s.bpffs_root).map(Some);
    }
    Ok(None)
}

/// How often expired conntrack entries are swept from user space.
const CONNTRACK_GC_INTERVAL: Duration = Duration::from_secs(60);
/// How often the datapath's counters are read into the metrics.
const STATS_INTERVAL: Duration = Duration::from_secs(10);

pub async fn run(mut s: Settings) -> Result<()> {
    let caps = Capabilities::current().context("reading the process capabilities")?;
    // The netfilter modes (and auto, which falls back to them) need no BPF rights; the
    // eBPF mode and --cleanup (which unloads the eBPF datapath) do.
    let needs_bpf = s.cli.cleanup || s.mode == ProxyMode::Ebpf;
    privileges::check_datapath(caps, needs_bpf, s.mode == ProxyMode::Userspace)?;
    if s.cli.cleanup {
        let lock = lock_root(&s, true)?;
        cleanup::remove_modes(None, &s).await?;
        if let Some(lock) = lock {
            lock.remove_record();
        }
        info!("cleanup done");
        return Ok(());
    }
    log_config_file_notes(&s);
    if s.mode == ProxyMode::Auto {
        s.mode = modes::choose(&s)?;
    }
    // Held until the process exits.
    let root_lock = lock_root(&s, s.mode == ProxyMode::Ebpf)?;
    info!("Using {} Proxier", s.mode);
    tune_kernel_conntrack(&s);
    host::raise_open_files_limit();

    // The source first: a missing API server or manifest path fails before the node is touched.
    let (reload_tx, mut reload_rx) = mpsc::channel(1);
    let (snapshot_tx, mut snapshot_rx) = mpsc::channel(8);
    let mut api_client = None;
    let _watcher = match &s.cli.manifests {
        Some(path) => Some(manifests::watch(path, s.cli.manifests_settle, reload_tx)?),
        None => {
            let client = api::client(s.kubeconfig.as_deref()).await?;
            info!(node = %s.node_name, "watching the API server");
            tokio::spawn(api::run(client.clone(), s.node_name.clone(), snapshot_tx));
            api_client = Some(client);
            None
        }
    };
    // The manifests are read while the mode starts (the eBPF programs load and verify in
    // the meantime): the API watchers likewise list on the runtime's workers.
    let first_read = s.cli.manifests.as_deref().map(|path| {
        let mut reader = manifests::Reader::new(path);
        tokio::task::spawn_blocking(move || reader.load().map(|set| (reader, set)))
    });
    info!(node = %s.node_name, sync_period = ?s.sync_period, min_sync_period = ?s.min_sync_period, "settings");

    let metrics = Arc::new(Metrics::new());
    let (mut proxier, mut ebpf) = modes::start(&s, &metrics)?;
    let health = ProxyHealth::new(2 * s.sync_period);
    health::serve(
        s.healthz,
        s.metrics,
        health.clone(),
        metrics.clone(),
        s.mode.as_str(),
    )
    .await?;
    let (inspect_tx, mut inspect_rx) = mpsc::channel(inspect::server::QUEUE);
    // Inspecting is for operators: a port someone else holds costs them the endpoint, not
    // the node its service.
    if let Err(e) =
        inspect::server::serve(s.inspect, inspect_tx, metrics.clone(), &s.bpffs_root).await
    {
        warn!("the inspect endpoint is not served: {e:#}");
    }
    let mut link_rx = ebpf.as_ref().and_then(|e| e.watch_links());

    let mut sigterm = tokio::signal::unix::signal(SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    let mut stats_tick = tokio::time::interval(STATS_INTERVAL);
    let mut gc_tick = tokio::time::interval(CONNTRACK_GC_INTERVAL);
    let mut sync_tick = tokio::time::interval(s.sync_period);
    sync_tick.tick().await; // the first tick is immediate; the start-up sync covers it
    let mut config_sync_tick = tokio::time::interval(s.config_sync_period);
    config_sync_tick.tick().await;

    let mut syncs = SyncLoop::new(LoopOptions::from(&s), health, metrics.clone());
    if let Some(client) = &api_client {
        syncs.set_events(crate::source::events::ServiceEvents::start(
            client.clone(),
            s.node_name.clone(),
        ));
    }
    let mut reader = None;
    match first_read {
        Some(read) => {
            let (r, set) = read.await.context("reading the manifests")??;
            syncs.ingest(set);
            reader = Some(r);
        }
        // Nothing is programmed before the API server has been listed once.
        None => match snapshot_rx.recv().await {
            Some(update) => syncs.ingest(update),
            None => bail!("the API-server source stopped"),
        },
    }
    if let Some(e) = ebpf.as_mut() {
        e.follow_masquerade_addresses(syncs.masquerade_addr, syncs.masquerade_addr6);
        e.follow_local_traffic(&syncs.local);
    }
    syncs.first_sync(&mut proxier);
    let mut leftovers = Leftovers::default();
    leftovers
        .take_over(&syncs, &s, root_lock.as_ref(), &metrics)
        .await;
    if let Some(client) = api_client {
        // As kube-proxy announces itself on its Node; best effort.
        tokio::spawn(api::announce_start(
            client,
            s.node_name.clone(),
            s.mode.as_str(),
        ));
    }

    let mut deferred: Option<Instant> = None;
    loop {
        let started = Instant::now();
        if leftovers
            .take_over(&syncs, &s, root_lock.as_ref(), &metrics)
            .await
        {
            loop_work(&metrics, "takeover", started);
        }
        let wait = deferred.map(|d| d.saturating_duration_since(Instant::now()));
        let flow_log = ebpf.as_mut().and_then(|e| e.flow_logger.as_mut());
        let has_flow_log = flow_log.is_some();
        let has_links = link_rx.is_some();
        tokio::select! {
            Some(()) = reload_rx.recv() => {
                if let Some(reader) = reader.as_mut() {
                    let started = Instant::now();
                    match reader.load() {
                        Ok(set) => {
                            let read = started.elapsed();
                            syncs.ingest(set);
                            debug!(
                                read_ms = read.as_secs_f64() * 1e3,
                                ingest_ms = (started.elapsed() - read).as_secs_f64() * 1e3,
                                "manifests reloaded"
                            );
                            loop_work(&metrics, "manifests", started);
                            deferred = syncs.sync_or_defer(&mut proxier);
                        }
                        Err(e) => warn!("manifests not reloaded: {e:#}"),
                    }
                }
            }
            Some(update) = snapshot_rx.recv() => {
                syncs.ingest(update);
                deferred = syncs.sync_or_defer(&mut proxier);
            }
            _ = tokio::time::sleep(wait.unwrap_or(Duration::from_secs(3600))), if wait.is_some() => {
                deferred = syncs.sync_or_defer(&mut proxier);
            }
            _ = sync_tick.tick() => syncs.periodic(&mut proxier),
            Some(query) = inspect_rx.recv() => {
                let started = Instant::now();
                query.answer(&syncs, &proxier, ebpf.as_ref());
                loop_work(&metrics, "inspect", started);
            }
            _ = config_sync_tick.tick() => {
                // A periodic re-read of the manifests, as kube-proxy's configSyncPeriod
                // resyncs its informers (the API watchers relist by themselves).
                if let Some(reader) = reader.as_mut() {
                    // Every file, in case a change slipped past its metadata.
                    reader.forget_files();
                    let started = Instant::now();
                    if let Ok(set) = reader.load() {
                        syncs.ingest(set);
                        loop_work(&metrics, "manifests", started);
                        deferred = syncs.sync_or_defer(&mut proxier);
                    }
                }
            }
            Ok(mut ready) = async { flow_log.unwrap().readable_mut().await }, if has_flow_log => {
                let started = Instant::now();
                ready.get_inner_mut().flush();
                ready.clear_ready();
                loop_work(&metrics, "flow_log", started);
            }
            Some(event) = async { link_rx.as_mut().unwrap().recv().await }, if has_links => {
                if let Some(e) = ebpf.as_mut() {
                    let started = Instant::now();
                    e.link_event(event);
                    loop_work(&metrics, "interfaces", started);
                }
            }
            _ = gc_tick.tick() => {
                if let Some(e) = ebpf.as_mut() {
                    let started = Instant::now();
                    e.collect_conntrack_garbage(&metrics);
                    loop_work(&metrics, "conntrack_gc", started);
                }
            }
            _ = stats_tick.tick() => {
                if let Some(e) = ebpf.as_mut() {
                    let started = Instant::now();
                    let ids = proxier.counter_ids(e.backend_metrics, e.traffic_metrics_limit);
                    if let Some((services, backends)) = ids {
                        e.read_counters(services, backends, &metrics);
                    }
                    loop_work(&metrics, "counters", started);
                }
            }
            _ = sigterm.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
        }
        if let Some(e) = ebpf.as_mut() {
            e.follow_masquerade_addresses(syncs.masquerade_addr, syncs.masquerade_addr6);
            e.follow_local_traffic(&syncs.local);
        }
    }
    match s.mode {
        ProxyMode::Ebpf => info!("stopping; the datapath keeps serving from the pinned state"),
        _ => info!("stopping; the rules stay in place"),
    }
    Ok(())
}

/// Records the sync loop's time on `work` (anything but a sync, which has its own
/// histograms): a change that arrives meanwhile waits for it, so long work shows here and,
/// from 50 ms, in the log.
fn loop_work(metrics: &Metrics, work: &str, started: Instant) {
    let took = started.elapsed();
    metrics
        .loop_work
        .with_label_values(&[work])
        .observe(took.as_secs_f64());
    if took >= Duration::from_millis(50) {
        debug!(
            work,
            took_ms = took.as_millis() as u64,
            "the sync loop was busy"
        );
    }
}

/// What the `--config` file said that the operator should know: warnings, and fields that
/// mean nothing to this agent.
fn log_config_file_notes(s: &Settings) {
    let Some(file) = &s.file else { return };
    for w in &file.warnings {
        warn!("--config: {w}");
    }
    if !file.ignored.is_empty() {
        info!(
            "--config: fields without meaning for this agent, ignored: {}",
            file.ignored.join(", ")
        );
    }
}

/// kube-proxy's kernel conntrack tuning; a failure is a warning, as no mode depends on it.
fn tune_kernel_conntrack(s: &Settings) {
    let tuning = s
        .file
        .as_ref()
        .map(|f| f.conntrack.kernel.clone())
        .unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    match sysctls::apply(std::path::Path::new("/"), &tuning, cpus) {
        Ok(Outcome::Applied(changed)) => {
            for (path, old, new) in changed {
                info!("kernel conntrack: /{path} {old} -> {new}");
            }
        }
        Ok(Outcome::NotInitialNamespace) => info!(
            "kernel conntrack left alone: not the node's initial network namespace (nf_conntrack_max is read-only here)"
        ),
        Ok(Outcome::NoConntrack) => debug!("kernel conntrack not loaded: nothing to tune"),
        Err(e) => warn!("kernel conntrack not tuned: {e:#}"),
    }
}
