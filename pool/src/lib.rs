//! The UMBP pool (docs/architecture.md): DRAM tier, allocator, eviction, index writer,
//! transfers and the socket server. A library so that the same code runs as the
//! standalone `umbp-pool` daemon and embedded inside one engine worker.
//!
//! Threads: one control thread (an event loop over the listener and every peer socket:
//! accepts, handshakes and control messages as per-peer state machines with deadlines,
//! peer liveness; memory registrations run on short-lived threads), one service thread (drains submission rings of every
//! attachment, sleeping on their eventfd doorbells when idle), `copy_threads` copy threads,
//! and one evictor.
//!
//! Module map: five rooms; imports run one way, down this list (a room imports only rooms
//! below it and the shared leaves). The crate root above them holds `Pool`, `PoolInner` and
//! `PoolError`. `store/` and `tier/` get handles (`store::Store`, `tier::TierWork`, the
//! registration's `Registrar`, the cluster's `ClusterAccess`); `copy/`, `peer/` and
//! `observe/` still take `PoolInner` from the crate root (splitting it into handles is
//! the next step, issue #41).
//! - `copy/`: the copy path: intake (the service thread), jobs and their blocks, copy
//!   threads and slots, stages, look-ahead promotion, finish and fences, idle polling.
//! - `peer/`: the socket server and control loop, validation, attachments, memory
//!   registration, the heartbeat and death notice in the index header.
//! - `observe/`: counters and latencies, the state report, Prometheus metrics.
//! - `tier/`: tiers below DRAM: the `TierSource` seam, promotion, demotion (the evictor
//!   thread), the SSD tier, the cluster seam (`remote`).
//! - `store/`: objects, slab allocator, DRAM and its pinning, event log, tenant groups,
//!   the store's priority lock.
//!
//! Shared leaves any room may import: `config/`, `pool_report.rs` (the report's types),
//! `poller.rs`, `fault.rs` (test hooks), `stop_signals.rs`.

pub mod config;
mod copy;
/// Fault injection and hold points for tests (feature `fault-injection`; off in the daemon).
#[cfg(feature = "fault-injection")]
pub mod fault;
#[cfg(not(feature = "fault-injection"))]
#[path = "fault_off.rs"]
mod fault;
mod observe;
mod peer;
mod poller;
pub mod pool_report;
mod stop_signals;
mod store;
mod tier;

/// A hold point the pool's other crates pass too (the cluster tier's threads): empty and
/// inlined away unless this build has `fault-injection`.
#[doc(hidden)]
pub use fault::{pass as pass_hold_point, HoldPoint};
#[doc(hidden)]
pub use peer::control;
pub use peer::validate;
pub use store::groups;
pub use tier::remote;

use copy::{copy_slots, idle_poll, job, promote, service, transfer};
use observe::{metrics, report, stats};
use peer::{liveness, server};
use store::{dram, event_log, pinning, priority_lock};
use tier::evictor;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use config::PAGE_BYTES;
pub use config::{parse_fraction, parse_size, ConfigError, ControlLimits, PeerLimits, PoolConfig, Progress, ProgressFn, UidLimits};
pub use event_log::EventLogError;
pub use pool_report::{PoolReport, Report, TenantReport};
pub use stop_signals::StopSignals;
pub use store::dram::DramError;
pub use store::objects::ObjectEvent;
pub use store::pinning::{gpu_pinners, DramPinner, GpuPinner};

/// Whether this build can arm test faults (`umbp_pool::fault`, feature `fault-injection`); the
/// daemon warns at start when it can.
pub const FAULT_INJECTION: bool = cfg!(feature = "fault-injection");

use peer::attachment::Attachment;
use store::objects::ObjectStore;
use umbp_ipc::doorbell::Doorbell;
use umbp_ipc::SharedMemory;

#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("another pool is already listening at {0}; stop it or choose another --socket")]
    AddressInUse(PathBuf),
    #[error("{path}: {message}")]
    Socket { path: PathBuf, message: String },
    #[error("metrics endpoint {addr}: {message}")]
    Metrics { addr: String, message: String },
    #[error(transparent)]
    Dram(#[from] DramError),
    #[error("DRAM tier: index of tenant group {group}: {source}")]
    IndexMemory { group: u32, source: umbp_ipc::ShmError },
    #[error("DRAM tier: index of tenant group {group}: {source}")]
    IndexFormat { group: u32, source: umbp_protocol::ProtocolError },
    #[error("DRAM tier: event log of tenant group {group}: {source}")]
    EventLog { group: u32, source: event_log::EventLogError },
    #[error("SSD tier: {0}")]
    Ssd(#[from] umbp_ssd::SsdError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

pub(crate) struct PoolInner {
    pub config: PoolConfig,
    /// DRAM, the object store, tenant groups and their regions (store/handle.rs).
    pub store: Arc<store::Store>,
    /// Tiers below DRAM (tier/mod.rs): where loads fetch objects not in DRAM from.
    pub tiers: tier::Tiers,
    pub attachments: Mutex<Vec<Arc<Attachment>>>,
    /// Distinct uids among `attachments`, set under its lock when one comes or goes: the
    /// per-uid copy-thread cap applies while it is above one (transfer.rs).
    pub attached_uids: std::sync::atomic::AtomicUsize,
    /// Copy threads held per peer and per uid, and the jobs their caps hold back.
    pub copy_slots: copy_slots::CopySlots,
    /// Wakes the service thread when attachments come or go, and at shutdown.
    pub service_wake: Doorbell,
    /// Wakes the control thread when a handshake finished, and at shutdown.
    pub control_wake: Doorbell,
    pub jobs: crossbeam_channel::Sender<job::Job>,
    /// Set once when the pool stops; shared with the DRAM registration thread (pinning.rs).
    pub shutdown: Arc<AtomicBool>,
    pub counters: stats::Counters,
    /// How long idle threads poll now, in ns (idle_poll.rs: fixed, or adapted by the
    /// service thread).
    pub idle_poll_ns: AtomicU64,
    /// A copy thread polls for jobs through all of the window (the others sleep after
    /// [`idle_poll::SHORT_POLL`]): one busy core, not one per copy thread.
    pub copy_poller: AtomicBool,
    /// When a copy thread last finished a job ([`idle_poll::ns_since`] `started`): the
    /// pool's threads poll from there, as a worker's next submission follows it.
    pub last_completion_ns: AtomicU64,
    /// The service thread is asleep (or about to be) in epoll: a completion while the
    /// window is long wakes it, so it polls for the worker's next submission.
    pub service_asleep: AtomicBool,
    pub next_id: AtomicU32,
    pub started: Instant,
    pub uid: u32,
    /// The cluster tier's source (remote.rs), once installed; `tiers.remote` reads it.
    pub remote_source: remote::RemoteSlot,
    /// Pipelined promotion (promote.rs): the promotion threads' queue and look-ahead.
    pub promoter: promote::Promoter,
}

impl PoolInner {
    /// What the DRAM registration threads use of the pool (pinning.rs).
    pub fn registrar(&self) -> pinning::Registrar {
        pinning::Registrar { store: self.store.clone(), stopping: self.shutdown.clone() }
    }

    /// What tier work uses of the pool (tier/mod.rs): the store and the lower tiers.
    pub fn tier_work(&self) -> tier::TierWork<'_> {
        tier::TierWork { store: &self.store, tiers: &self.tiers }
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }

    /// How long idle threads poll now (idle_poll.rs).
    pub fn idle_poll(&self) -> Duration {
        Duration::from_nanos(self.idle_poll_ns.load(Ordering::Relaxed))
    }

    /// A copy thread finished a job: the pool's threads poll from now for the worker's
    /// next submission; the service thread, if asleep through the copy, is woken for it
    /// when the window is longer than its short spin.
    pub fn note_completion(&self) {
        // SeqCst pairs with the service thread's store to `service_asleep` and its re-read
        // of this word (service.rs): one of the two sees the other. Only speed depends on
        // it: a missed wake costs one doorbell, as the worker's next submission finds the
        // rings armed (`need_wakeup`) and rings it.
        self.last_completion_ns.store(idle_poll::ns_since(self.started), Ordering::SeqCst);
        if idle_poll::polls_after_completion(self.idle_poll()) && self.service_asleep.swap(false, Ordering::SeqCst) {
            self.service_wake.ring();
        }
    }

    /// Time since the pool's last activity: `last_work` (the caller's) or the last completion.
    pub fn idle_since(&self, last_work: Instant) -> Duration {
        let completed = Duration::from_nanos(self.last_completion_ns.load(Ordering::SeqCst));
        let now = self.started.elapsed();
        last_work.elapsed().min(now.saturating_sub(completed))
    }
}

/// A running pool. Dropping it shuts it down.
pub struct Pool {
    inner: Arc<PoolInner>,
    threads: Vec<JoinHandle<()>>,
    socket_path: PathBuf,
    registration: Option<JoinHandle<pinning::Registrations>>,
}

impl Pool {
    /// Validates the config, creates DRAM and index, binds the socket and starts serving.
    pub fn start(config: PoolConfig) -> Result<Pool, PoolError> {
        Self::start_with_pinners(config, pinning::gpu_pinners())
    }

    /// `start`, pinning the DRAM tier with `pinners` instead of the GPU drivers found on
    /// the machine (an empty list: never pinned). For tests of the background pinning on
    /// machines without a GPU; a production pool uses `start`.
    pub fn start_with_pinners(config: PoolConfig, pinners: Vec<Arc<dyn DramPinner>>) -> Result<Pool, PoolError> {
        config.validate()?;
        let listener = server::bind(&config.socket_path, config.socket_group)?;
        // A failed start must not leave a socket file behind.
        let path = config.socket_path.clone();
        Self::start_bound(config, listener, pinners).inspect_err(|_| {
            let _ = std::fs::remove_file(&path);
        })
    }

    fn start_bound(
        mut config: PoolConfig,
        listener: std::os::unix::net::UnixListener,
        pinners: Vec<Arc<dyn DramPinner>>,
    ) -> Result<Pool, PoolError> {
        // The config is fixed for the pool's life; the idle-poll mode is taken in range once.
        config.idle_poll = config.idle_poll.clamped();
        let dram = dram::Dram::create(&config)?;
        let tenant_groups = groups::TenantGroups::from_acl(&config.namespace_acl);
        if tenant_groups.len() > groups::MAX_GROUPS {
            return Err(ConfigError::Invalid {
                key: "namespace-acl".into(),
                message: format!(
                    "{} tenant groups (namespaces listed for distinct sets of uids); a pool makes at most {}",
                    tenant_groups.len(),
                    groups::MAX_GROUPS
                ),
            }
            .into());
        }
        let slots = umbp_protocol::index::slots_for(config.capacity_bytes, config.min_object_bytes);
        // The SSD tier opens (and reads its segments) before anything is listed; its
        // objects take index entries too, so the indexes are sized for both tiers.
        let ssd = config.ssd.as_ref().map(tier::SsdTier::open).transpose()?.map(Arc::new);
        let listed_bytes = config.capacity_bytes + ssd.as_ref().map_or(0, |s| s.store.stats().capacity_bytes);
        // One index and one event log per tenant group (one without --namespace-acl).
        let mut group_mem = Vec::with_capacity(tenant_groups.len());
        for g in 0..tenant_groups.len() as u32 {
            let share = tenant_groups.index_share(g, config.namespace_share);
            let sized_for = ((listed_bytes as f64 * share) as u64).max(1);
            group_mem.push(create_group(
                &config,
                g,
                tenant_groups.len(),
                umbp_protocol::index::slots_for(sized_for, config.min_object_bytes),
            )?);
        }
        let (index_mems, logs): (Vec<_>, Vec<_>) = group_mem.into_iter().unzip();
        let mut store = ObjectStore::with_groups(dram.len() as u64, index_mems.clone());
        // Namespace quotas are shares of an index sized for the whole pool (3/4 of its slots).
        store.set_policy(store::objects::Policy::from_config(&config, dram.len() as u64, slots / 4 * 3));
        store.set_quarantine_max_bytes(config.quarantine_max_bytes.unwrap_or(dram.len() as u64 / 8));
        let mut group_mem = Vec::with_capacity(logs.len());
        for (g, (index_mem, log)) in index_mems.into_iter().zip(logs).enumerate() {
            group_mem.push(store::GroupMemory { index_mem, events_mem: log.memory().clone() });
            store.set_event_log(g as u32, log);
        }
        if let Some(ssd) = &ssd {
            store.set_ssd_admission(ssd.config.admission);
            tier::restore(&mut store, &tenant_groups, ssd);
        }
        let metrics_listener = config.metrics_addr.as_deref().map(|a| metrics::bind(a, config.metrics_group)).transpose()?;
        let (jobs_tx, jobs_rx) = crossbeam_channel::unbounded();
        let socket_path = config.socket_path.clone();
        let remote_source = remote::RemoteSlot::default();
        let (promoter, promotions_rx) = promote::Promoter::new(config.promotion_ahead_bytes, dram.len() as u64);
        let lower_objects = store.lower_objects_counter();
        let store = Arc::new(store::Store {
            objects: priority_lock::PriorityMutex::new(store),
            lower_objects,
            dram,
            tenant_groups,
            group_mem,
            evict_wake: (Mutex::new(false), Condvar::new()),
        });
        let inner = Arc::new(PoolInner {
            store,
            tiers: tier::Tiers { ssd, remote: Some(Arc::new(remote_source.clone())) },
            attachments: Mutex::new(Vec::new()),
            attached_uids: std::sync::atomic::AtomicUsize::new(0),
            copy_slots: copy_slots::CopySlots::default(),
            service_wake: Doorbell::new()?,
            control_wake: Doorbell::new()?,
            jobs: jobs_tx,
            shutdown: Arc::new(AtomicBool::new(false)),
            counters: stats::Counters::default(),
            copy_poller: AtomicBool::new(false),
            idle_poll_ns: AtomicU64::new(idle_poll::initial_window(config.idle_poll).as_nanos() as u64),
            last_completion_ns: AtomicU64::new(0),
            service_asleep: AtomicBool::new(false),
            next_id: AtomicU32::new(1),
            started: Instant::now(),
            uid: rustix::process::getuid().as_raw(),
            remote_source,
            promoter,
            config,
        });
        let mut threads = Vec::new();
        let spawn =
            |name: &str, f: Box<dyn FnOnce() + Send>| std::thread::Builder::new().name(name.to_string()).spawn(f).map_err(PoolError::Io);
        for i in 0..inner.config.copy_threads {
            let (inner, rx) = (inner.clone(), jobs_rx.clone());
            threads.push(spawn(&format!("umbp-copy-{i}"), Box::new(move || transfer::run_copy_thread(&inner, rx)))?);
        }
        for i in 0..promote::PROMOTION_THREADS {
            let (inner, rx) = (inner.clone(), promotions_rx.clone());
            threads.push(spawn(&format!("umbp-promote-{i}"), Box::new(move || promote::run_promotion_thread(&inner, rx)))?);
        }
        let i2 = inner.clone();
        threads.push(spawn("umbp-service", Box::new(move || service::run(&i2)))?);
        // The evictor gets the store, the tiers and the stop flag, nothing else.
        let (store, tiers, stopping) = (inner.store.clone(), inner.tiers.clone(), inner.shutdown.clone());
        threads.push(spawn("umbp-evictor", Box::new(move || evictor::run(tier::TierWork { store: &store, tiers: &tiers }, &stopping)))?);
        let i4 = inner.clone();
        threads.push(spawn("umbp-control", Box::new(move || server::run_control(&i4, listener)))?);
        let (store, stopping) = (inner.store.clone(), inner.shutdown.clone());
        threads.push(spawn("umbp-liveness", Box::new(move || liveness::run(&store, &stopping)))?);
        if let Some(l) = metrics_listener {
            let i5 = inner.clone();
            threads.push(spawn("umbp-metrics", Box::new(move || metrics::serve(&i5, l)))?);
        }
        let registration = pinning::register_dram(&inner.registrar(), pinners);
        tracing::info!(
            socket = %socket_path.display(),
            capacity_bytes = inner.config.capacity_bytes,
            index_slots = slots,
            tenant_groups = inner.store.tenant_groups.len(),
            copy_threads = inner.config.copy_threads,
            "umbp pool listening"
        );
        Ok(Pool { inner, threads, socket_path, registration })
    }

    pub fn socket_path(&self) -> &Path {
        &self.socket_path
    }

    /// The state report that ringtool shows (serializes to its JSON form).
    pub fn report(&self) -> PoolReport {
        report::build(&self.inner)
    }

    /// Background registration of DRAM with the GPU drivers: `(bytes registered, done)`.
    /// Until done, only the registered part is handed to objects (benchmarks wait for it).
    pub fn dram_registration(&self) -> (u64, bool) {
        self.inner.store.dram.registration()
    }

    /// Bytes of DRAM handed to objects (published or being written).
    pub fn allocated_bytes(&self) -> u64 {
        self.inner.store.objects.lock().expect("store lock").allocated_bytes()
    }

    pub fn attachment_count(&self) -> usize {
        self.inner.attachments.lock().expect("attachments lock").len()
    }

    /// Keys stored or removed since the last call (for KV events).
    /// The cluster tier's handle on this pool (remote.rs).
    pub fn cluster_access(&self) -> remote::ClusterAccess {
        remote::ClusterAccess { store: self.inner.store.clone(), remote_source: self.inner.remote_source.clone() }
    }

    pub fn take_events(&self) -> Vec<ObjectEvent> {
        self.inner.store.objects.lock().expect("store lock").take_events()
    }

    /// Stops serving: peers see EOF, in-flight copies finish, the socket file goes.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if self.inner.shutdown.swap(true, Ordering::AcqRel) {
            return;
        }
        // Schedulers stop trusting the index before anything it names is released
        // (docs/protocol.md, "Pool liveness").
        for g in &self.inner.store.group_mem {
            // SAFETY: the pool's own writable mapping of the index, alive as long as `inner`.
            if let Ok(view) = unsafe { umbp_protocol::index::IndexView::attach(g.index_mem.as_ptr(), g.index_mem.len()) } {
                // SAFETY: that mapping is writable (the pool is the index's writer).
                unsafe { view.mark_closed() };
            }
        }
        self.inner.service_wake.ring();
        self.inner.control_wake.ring();
        self.inner.store.wake_evictor();
        for t in self.threads.drain(..) {
            t.thread().unpark();
            let _ = t.join();
        }
        // Every pool thread is gone: keep the cache warm for the next start.
        if let Some(ssd) = &self.inner.tiers.ssd {
            tier::flush_on_stop(self.inner.tier_work(), ssd, ssd.config.flush_on_stop);
        }
        if let Some(reg) = self.registration.take() {
            for (pinner, base) in reg.join().unwrap_or_default() {
                // SAFETY: pinned by `register_dram`; every copy thread has exited.
                if let Err(e) = unsafe { pinner.unpin(base as *mut u8) } {
                    tracing::warn!(base, "unpinning DRAM with {} failed: {e}", pinner.name());
                }
            }
        }
        // Taken out first: dropping the last reference to an attachment closes its GPU
        // regions (gpu locks), which must not happen under `attachments` (lock order).
        let attachments = std::mem::take(&mut *self.inner.attachments.lock().expect("attachments lock"));
        for a in attachments {
            a.alive.store(false, Ordering::Release);
            let _ = a.socket.shutdown(std::net::Shutdown::Both);
        }
        let _ = std::fs::remove_file(&self.socket_path);
        tracing::info!(socket = %self.socket_path.display(), "umbp pool stopped");
    }
}

/// Creates, formats and seals group `g`'s index (`slots` slots, its own random seed) and
/// event log. Names: `umbp-index` / `umbp-events` when there is one group, else with `-gN`.
fn create_group(
    config: &PoolConfig,
    g: u32,
    groups: usize,
    slots: u64,
) -> Result<(Arc<SharedMemory>, event_log::SharedEventLog), PoolError> {
    let suffix = if groups == 1 { String::new() } else { format!("-g{g}") };
    let index_mem = SharedMemory::create(&format!("umbp-index{suffix}"), umbp_protocol::index::region_bytes(slots), false)
        .map_err(|source| PoolError::IndexMemory { group: g, source })?;
    // SAFETY: a fresh zeroed mapping that only this pool writes.
    unsafe { umbp_protocol::index::IndexView::init_seeded(index_mem.as_ptr(), index_mem.len(), slots, store::objects::index_seed()) }
        .map_err(|source| PoolError::IndexFormat { group: g, source })?;
    // Schedulers map it read-only: no writable mapping can be made from now on.
    index_mem.seal_read_only().map_err(|source| PoolError::IndexMemory { group: g, source })?;
    let log = event_log::SharedEventLog::create(&format!("umbp-events{suffix}"), config.event_log_entries)
        .map_err(|source| PoolError::EventLog { group: g, source })?;
    Ok((Arc::new(index_mem), log))
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.stop();
    }
}
