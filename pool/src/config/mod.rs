//! Pool configuration: the values, their defaults (from the settings table, `settings.rs`),
//! their checks (`PoolConfig::validate`) and the parsers for the seed-compatible spellings
//! (`64GiB` sizes, `0.9` watermarks).

pub mod settings;
mod ssd;

use std::path::PathBuf;
use std::time::Duration;

use settings::Setting;
pub use ssd::SsdSettings;

/// The DRAM tier's page (store/alloc.rs cuts DRAM into these); here so that `validate` can
/// check the capacity against it without importing the store.
pub const PAGE_BYTES: u64 = 2 << 20;
/// Default `--copy-stage-size` (the table's, checked by its tests). H200, 469 MiB submissions
/// of 64 KiB pages: store/load 48.2/49.8 GB/s in one stage, 50.0/49.3 in 16 MiB stages,
/// 50.8/50.9 in 32, 51.3/51.7 in 64, 51.5/51.9 in 128; 64 MiB keeps smaller submissions
/// pipelined too.
pub const DEFAULT_COPY_STAGE_BYTES: u64 = 64 << 20;
/// `--copy-stage-growth auto`: by the page size (`umbp_protocol::stage_split::auto_growth_percent`).
pub use umbp_protocol::stage_split::AUTO_GROWTH as AUTO_COPY_STAGE_GROWTH;
/// Default `--copy-stage-growth` (the table's `auto`).
pub const DEFAULT_COPY_STAGE_GROWTH_PERCENT: u32 = AUTO_COPY_STAGE_GROWTH;
/// Longest `idle_poll` accepted (`--idle-poll-us`).
pub const MAX_IDLE_POLL: Duration = Duration::from_secs(1);
/// The most `--idle-poll-us auto` polls: longer than the gap between a worker's
/// back-to-back transfers (a lookup and a submission: 0.5-3 ms measured between the
/// bench's transfers on the 2-core VM), far shorter than an engine step, so a pool serving
/// engines that submit once a step sleeps between them.
pub const AUTO_IDLE_POLL_MAX: Duration = Duration::from_millis(2);
/// Default `idle_poll` (the table's `auto`): adaptive (pool/src/copy/idle_poll.rs).
pub const DEFAULT_IDLE_POLL: IdlePoll = IdlePoll::Auto { max: AUTO_IDLE_POLL_MAX };

/// How long the service thread and a copy thread poll for work after the pool's last
/// activity before they sleep (`--idle-poll-us`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdlePoll {
    /// Always this long (`--idle-poll-us N`).
    Fixed(Duration),
    /// From 50 µs up to `max`, longer while work keeps arriving soon after the threads
    /// slept (`--idle-poll-us auto`).
    Auto { max: Duration },
}

impl IdlePoll {
    /// Within [`MAX_IDLE_POLL`].
    pub fn clamped(self) -> Self {
        match self {
            IdlePoll::Fixed(d) => IdlePoll::Fixed(d.min(MAX_IDLE_POLL)),
            IdlePoll::Auto { max } => IdlePoll::Auto { max: max.min(MAX_IDLE_POLL) },
        }
    }
}

impl std::fmt::Display for IdlePoll {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IdlePoll::Fixed(d) => write!(f, "{}", d.as_micros()),
            IdlePoll::Auto { max } if *max == AUTO_IDLE_POLL_MAX => write!(f, "auto"),
            IdlePoll::Auto { max } => write!(f, "auto (up to {} µs)", max.as_micros()),
        }
    }
}

impl std::str::FromStr for IdlePoll {
    type Err = String;

    /// `auto`, or µs from 0 to 1,000,000.
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "auto" {
            return Ok(DEFAULT_IDLE_POLL);
        }
        let max = MAX_IDLE_POLL.as_micros();
        match s.parse::<u64>() {
            Ok(us) if us as u128 <= max => Ok(IdlePoll::Fixed(Duration::from_micros(us))),
            _ => Err(format!("'{s}' is not `auto` or a whole number of µs from 0 to {max}")),
        }
    }
}
/// Default `promotion_ahead_bytes` (the table's): two default stages. (It was 0 for a while, on a
/// network-partition test failure wrongly laid at its door: the failing load is one stage
/// and launches nothing ahead, `promotions_ahead` 0 with either setting.)
pub const DEFAULT_PROMOTION_AHEAD_BYTES: u64 = 128 << 20;

/// Everything a pool needs to start. `Default` gives the documented defaults.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Unix socket the pool listens on.
    pub socket_path: PathBuf,
    /// Bytes of DRAM the pool holds objects in.
    pub capacity_bytes: u64,
    /// The evictor starts above this fraction of capacity...
    pub high_watermark: f64,
    /// ...and stops below this one.
    pub low_watermark: f64,
    /// Back DRAM with 2 MiB huge pages (needs free pages in /proc/sys/vm/nr_hugepages).
    pub hugepages: bool,
    /// Bind DRAM to this NUMA node with mbind.
    pub numa_node: Option<u32>,
    /// Touch every page at start so first stores do not pay page faults.
    pub prefault: bool,
    /// Peer uids allowed besides the pool's own (root is always allowed).
    pub allow_uids: Vec<u32>,
    /// Smallest object the index is sized for (fixes the index capacity).
    pub min_object_bytes: u64,
    /// How long a touch hint protects an object from eviction.
    pub lease: Duration,
    /// Threads that run copies.
    pub copy_threads: usize,
    /// Copy threads one attachment may occupy at once (0 = all but one): a peer whose
    /// copies wait (an unwritten store fence, slow memory) never holds every thread.
    pub copy_threads_per_peer: usize,
    /// How long a copy thread waits for a worker's store fence word before the store
    /// fails (`--store-fence-timeout-ms`): a worker whose stream never writes it holds that
    /// copy thread this long.
    pub store_fence_timeout: Duration,
    /// A submission moving more than this is copied in stages of up to this size, each
    /// published as it lands while the next ones copy (the first stages smaller:
    /// `umbp_protocol::stage_split`); 0 = one stage.
    pub copy_stage_bytes: u64,
    /// Each copy stage is this percentage of the one before, up to `copy_stage_bytes`
    /// (100: all as small as the first; 200: doubling; 0: by the layout's page size).
    pub copy_stage_growth_percent: u32,
    /// Loads from lower tiers (SSD, remote pools): bytes of DRAM the pool promotes ahead of
    /// the stage a load copies (its later stages, the peer's next loads), so that fetches
    /// overlap copies (pool/src/copy/promote.rs); 0 = each stage fetched when it is reached.
    pub promotion_ahead_bytes: u64,
    /// Bound on DRAM quarantined because a transfer may still write it (a remote read that
    /// timed out; pool/src/store/objects/quarantine.rs): at it, promotions from the remote tier
    /// are misses until quarantined ranges are reclaimed. None: 1/8 of `capacity_bytes`.
    pub quarantine_max_bytes: Option<u64>,
    /// How long the service thread and a copy thread keep polling for work after the
    /// pool's last activity before they sleep. Waking a sleeping thread costs tens to
    /// hundreds of µs on a VM (the vCPU halted); polling through the gap between a worker's
    /// transfers removes that from every transfer at the price of a busy core per polling
    /// thread while traffic flows.
    pub idle_poll: IdlePoll,
    /// How GPU copy calls are submitted (streams, batching); passed with every transfer.
    pub engine: umbp_gpu::EngineConfig,
    /// Attachments the pool serves at once (all peers together).
    pub max_attachments: usize,
    pub default_sq_entries: u32,
    pub default_arena_bytes: u64,
    /// Limits per peer (docs/security.md). A peer over one gets a refusal or a `Busy`
    /// completion naming the limit; other peers are unaffected.
    pub limits: PeerLimits,
    /// Group that owns the socket (mode 0660): its members may connect. None: the pool's
    /// primary group.
    pub socket_group: Option<u32>,
    /// Namespaces each uid may attach with. Empty: no restriction. Non-empty: every uid
    /// other than the pool's own and root must be listed and may only use its namespaces,
    /// and a load only finds objects stored under the loader's own namespace.
    pub namespace_acl: std::collections::BTreeMap<u32, Vec<u128>>,
    /// Take peers' pidfds with `pidfd_open` + start time even where `SO_PEERPIDFD`
    /// exists (tests of the older kernels' path; docs/security.md item 1).
    pub peer_pidfd_fallback: bool,
    /// Serve Prometheus metrics on GET /metrics at this address: `unix:PATH` (a unix
    /// socket, mode 0600, or 0660 with `metrics_group`), or TCP `[HOST:]PORT` (loopback
    /// when HOST is left out; every local user can read it).
    pub metrics_addr: Option<String>,
    /// Group whose members may read the metrics unix socket (mode 0660). None: only the
    /// pool's uid and root (mode 0600, and the peer's uid is checked at accept).
    pub metrics_group: Option<u32>,
    /// Entries of the shared KV event log (power of two).
    pub event_log_entries: u32,
    // --- Tenant defences (docs/security.md "Index flooding", "Touch hints") ---
    /// Share of the index's entries and of DRAM that one namespace may hold (1 = no
    /// quota); above this share times the high watermark the evictor evicts that
    /// namespace's own least recently used objects, and at the share its stores are
    /// `NotStored`.
    pub namespace_share: f64,
    /// Share of DRAM that one uid's touch hints may keep leased at once; past it, that
    /// uid's oldest leases end early.
    pub lease_share: f64,
    /// Deadlines and caps of the control plane (handshakes, control messages, fds).
    pub control: ControlLimits,
    /// Limits on what all attachments of one uid hold together (docs/security.md):
    /// without them the per-attachment limits multiply by `attachments_per_uid`.
    pub uid_limits: UidLimits,
    /// The SSD tier below DRAM (docs/ssd.md): evicted objects admitted by
    /// `ssd.admission` are demoted there and promoted back on a load; a restart on the same
    /// directories serves them again. None: DRAM only.
    pub ssd: Option<umbp_ssd::SsdConfig>,
    /// Told the progress of long start-up steps (prefaulting DRAM); the daemon draws a
    /// progress bar with it. None: progress is only logged (debug).
    pub progress: Option<ProgressFn>,
}

/// Progress of a long start-up step (prefaulting DRAM), for [`PoolConfig::progress`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// What is being done, e.g. "prefaulting DRAM".
    pub what: &'static str,
    pub done_bytes: u64,
    pub total_bytes: u64,
}

/// A progress callback ([`PoolConfig::progress`]).
#[derive(Clone)]
pub struct ProgressFn(std::sync::Arc<dyn Fn(&Progress) + Send + Sync>);

impl ProgressFn {
    pub fn new(f: impl Fn(&Progress) + Send + Sync + 'static) -> Self {
        Self(std::sync::Arc::new(f))
    }

    pub fn call(&self, p: &Progress) {
        (self.0)(p)
    }
}

impl std::fmt::Debug for ProgressFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProgressFn(..)")
    }
}

/// Control-plane deadlines and caps (docs/security.md, "Denial of service").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlLimits {
    /// A connection's whole Hello must arrive within this, counted from accept (after
    /// the uid check), however the peer spreads its bytes.
    pub handshake_timeout: std::time::Duration,
    /// Each control message must be complete within this of its first byte, and each
    /// reply taken by the peer within this of being sent.
    pub message_timeout: std::time::Duration,
    /// Handshakes in progress at once, all uids together.
    pub max_handshakes: usize,
    /// Handshakes in progress at once for one uid.
    pub handshakes_per_uid: usize,
    /// File descriptors kept free below RLIMIT_NOFILE: a peer accepted into fewer is
    /// refused at once (`ResourceExhausted`), so attached peers can still pass memfds.
    pub fd_reserve: u64,
}

impl Default for ControlLimits {
    fn default() -> Self {
        use settings::*;
        Self {
            handshake_timeout: table_default(&HANDSHAKE_TIMEOUT_MS, parse_millis),
            message_timeout: table_default(&CONTROL_TIMEOUT_MS, parse_millis),
            max_handshakes: table_default(&MAX_HANDSHAKES, parse_number),
            handshakes_per_uid: table_default(&MAX_HANDSHAKES_PER_UID, parse_number),
            fd_reserve: table_default(&FD_RESERVE, parse_number),
        }
    }
}

/// What all live attachments of one uid may hold together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UidLimits {
    /// Registered regions (each an fd and a mapping in the pool; fence pages included).
    pub regions: usize,
    /// Registered bytes, all regions together.
    pub registered_bytes: u64,
    /// KV layouts (each pool memory).
    pub layouts: usize,
}

impl Default for UidLimits {
    /// Four times the per-attachment limits (the table's `--max-*-per-uid` defaults).
    fn default() -> Self {
        UidLimits::four_times(&PeerLimits::default())
    }
}

impl UidLimits {
    /// Four times `per_peer`'s regions, bytes and layouts: a uid may hold four fully used
    /// attachments.
    pub fn four_times(per_peer: &PeerLimits) -> Self {
        Self {
            regions: per_peer.regions.saturating_mul(4),
            registered_bytes: per_peer.registered_bytes.saturating_mul(4),
            layouts: per_peer.layouts.saturating_mul(4),
        }
    }
}

/// Per-peer resource limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerLimits {
    /// Live attachments one uid may hold.
    pub attachments_per_uid: usize,
    /// Bytes of memory one attachment may register (all its regions together).
    pub registered_bytes: u64,
    /// Regions one attachment may register (each holds an fd in the pool).
    pub regions: usize,
    /// KV layouts (cache groups) one attachment may register.
    pub layouts: usize,
    /// Submissions of one attachment in flight (also capped by its completion ring).
    pub inflight: u32,
    /// Bytes that one attachment's in-flight submissions may move (count x object bytes).
    /// A submission is always admitted when nothing of the attachment is in flight.
    pub inflight_bytes: u64,
    /// Largest arena a peer may ask for in its Hello.
    pub arena_bytes: u64,
    /// Largest submission ring a peer may ask for in its Hello.
    pub sq_entries: u32,
}

impl Default for PeerLimits {
    fn default() -> Self {
        use settings::*;
        Self {
            attachments_per_uid: table_default(&MAX_ATTACHMENTS_PER_UID, parse_number),
            registered_bytes: table_default(&MAX_REGISTERED_BYTES, parse_size),
            regions: table_default(&MAX_REGIONS, parse_number),
            layouts: table_default(&MAX_LAYOUTS, parse_number),
            inflight: table_default(&MAX_INFLIGHT, parse_number),
            inflight_bytes: table_default(&MAX_INFLIGHT_BYTES, parse_size),
            arena_bytes: table_default(&MAX_ARENA_BYTES, parse_size),
            sq_entries: table_default(&MAX_SQ_ENTRIES, parse_number),
        }
    }
}

impl Default for PoolConfig {
    fn default() -> Self {
        use settings::*;
        Self {
            socket_path: umbp_ipc::default_socket_path(),
            capacity_bytes: default_capacity(),
            high_watermark: table_default(&HIGH_WM, parse_fraction),
            low_watermark: table_default(&LOW_WM, parse_fraction),
            hugepages: table_default(&HUGEPAGES, parse_bool),
            numa_node: None,
            prefault: table_default(&PREFAULT, parse_bool),
            allow_uids: Vec::new(),
            min_object_bytes: table_default(&MIN_OBJECT_SIZE, parse_size),
            lease: table_default(&LEASE_MS, parse_millis),
            copy_threads: std::thread::available_parallelism().map(|n| n.get().clamp(2, 8)).unwrap_or(2),
            copy_threads_per_peer: table_default(&COPY_THREADS_PER_PEER, parse_number),
            store_fence_timeout: table_default(&STORE_FENCE_TIMEOUT_MS, parse_millis),
            copy_stage_bytes: table_default(&COPY_STAGE_SIZE, parse_size),
            copy_stage_growth_percent: table_default(&COPY_STAGE_GROWTH, parse_growth),
            promotion_ahead_bytes: table_default(&PROMOTION_AHEAD, parse_size),
            quarantine_max_bytes: None,
            idle_poll: table_default(&IDLE_POLL_US, parse_idle_poll),
            engine: default_engine(),
            max_attachments: table_default(&MAX_ATTACHMENTS, parse_number),
            default_sq_entries: 1024,
            default_arena_bytes: 4 << 20,
            limits: PeerLimits::default(),
            socket_group: None,
            namespace_acl: Default::default(),
            peer_pidfd_fallback: false,
            metrics_addr: None,
            metrics_group: None,
            event_log_entries: umbp_protocol::events::DEFAULT_EVENT_CAPACITY,
            control: ControlLimits::default(),
            uid_limits: UidLimits::default(),
            namespace_share: table_default(&NAMESPACE_SHARE, parse_fraction),
            lease_share: table_default(&LEASE_SHARE, parse_fraction),
            ssd: None,
            progress: None,
        }
    }
}

/// Errors that name the offending key and value.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("{key}: cannot parse {value:?} as a size (examples: 64GiB, 512MiB, 1073741824)")]
    BadSize { key: String, value: String },
    #[error("{key}: {value:?} is not a fraction between 0 and 1")]
    BadFraction { key: String, value: String },
    #[error("{key}: {message}")]
    Invalid { key: String, message: String },
    /// A setting of the table: shown as the daemon names it (`flag (ENV)`);
    /// [`ConfigError::naming_keyword`] names it as the embedded pool's keyword argument.
    #[error("{}: {message}", setting.label())]
    Setting { setting: &'static Setting, message: String },
}

impl ConfigError {
    fn setting(setting: &'static Setting, message: impl Into<String>) -> Self {
        ConfigError::Setting { setting, message: message.into() }
    }

    /// The message with a table setting named by its keyword argument (`ssd_dir: ...`), as
    /// the Python binding reports it.
    pub fn naming_keyword(&self) -> String {
        match self {
            ConfigError::Setting { setting, message } => format!("{}: {message}", setting.name),
            other => other.to_string(),
        }
    }
}

/// `setting`'s default through `parse`, the parser its faces use; every default parses
/// (the table's tests).
fn table_default<T>(setting: &'static Setting, parse: fn(&str, &str) -> Result<T, ConfigError>) -> T {
    parse(setting.flag, setting.default_str()).unwrap_or_else(|e| panic!("settings table: {e}"))
}

/// The GPU copy engine's settings at the table's defaults (`umbp_gpu::EngineConfig::default()`
/// agrees: a test checks).
fn default_engine() -> umbp_gpu::EngineConfig {
    use settings::*;
    let mut e = umbp_gpu::EngineConfig::default();
    e.streams = table_default(&COPY_STREAMS, parse_number);
    e.batch = table_default(&COPY_BATCH, parse_bool);
    e.batch_max = table_default(&COPY_BATCH_MAX, parse_number);
    e.parallel_submit = table_default(&COPY_PARALLEL_SUBMIT, parse_bool);
    e.gather.mode = table_default(&COPY_KERNEL, parse_copy_kernel);
    e.gather.blocks = table_default(&COPY_KERNEL_BLOCKS, parse_number);
    e.gather.launch_bytes = table_default(&COPY_KERNEL_LAUNCH_SIZE, parse_size) as usize;
    e.gather.split_streams = table_default(&COPY_SPLIT_STREAMS, parse_number);
    e
}

/// A whole number (`1024`); an error names `key`.
pub fn parse_number<T: std::str::FromStr>(key: &str, value: &str) -> Result<T, ConfigError> {
    value.trim().parse().map_err(|_| ConfigError::Invalid { key: key.into(), message: format!("{value:?} is not a whole number in range") })
}

/// Milliseconds (`2000`) as a duration; an error names `key`.
pub fn parse_millis(key: &str, value: &str) -> Result<Duration, ConfigError> {
    parse_number(key, value).map(Duration::from_millis)
}

/// Seconds (`20`, `2.5`, `0`, at most a day) as a duration; an error names `key`.
pub fn parse_seconds(key: &str, value: &str) -> Result<Duration, ConfigError> {
    match value.trim().parse::<f64>() {
        Ok(s) if s.is_finite() && (0.0..=86_400.0).contains(&s) => Ok(Duration::from_secs_f64(s)),
        _ => Err(ConfigError::Invalid { key: key.into(), message: format!("{value:?} is not a number of seconds from 0 to 86400") }),
    }
}

/// `true`/`false` and their usual spellings (`1`/`0`, `yes`/`no`, `on`/`off`), as clap's
/// boolish parser takes them; an error names `key`.
pub fn parse_bool(key: &str, value: &str) -> Result<bool, ConfigError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "y" | "on" => Ok(true),
        "0" | "false" | "no" | "n" | "off" => Ok(false),
        _ => Err(ConfigError::Invalid { key: key.into(), message: format!("{value:?} is not true or false") }),
    }
}

/// `--copy-stage-growth`: `auto` (0) or a percentage from 100 to 1000.
pub fn parse_growth(key: &str, value: &str) -> Result<u32, ConfigError> {
    if value == "auto" {
        return Ok(AUTO_COPY_STAGE_GROWTH);
    }
    match value.parse::<u32>() {
        Ok(p) if (100..=1000).contains(&p) => Ok(p),
        _ => Err(ConfigError::Invalid { key: key.into(), message: format!("{value:?}: expected auto or a percentage from 100 to 1000") }),
    }
}

/// `--idle-poll-us`: `auto` or µs from 0 to 1,000,000.
pub fn parse_idle_poll(key: &str, value: &str) -> Result<IdlePoll, ConfigError> {
    value.parse().map_err(|message| ConfigError::Invalid { key: key.into(), message })
}

/// `--copy-kernel`: how GPU copies of small pages run.
pub fn parse_copy_kernel(key: &str, value: &str) -> Result<umbp_gpu::GatherMode, ConfigError> {
    use umbp_gpu::GatherMode;
    Ok(match value {
        "auto" => GatherMode::Auto,
        "kernel" => GatherMode::Kernel,
        "copy-engine" => GatherMode::CopyEngine,
        "staged" => GatherMode::Staged,
        _ => {
            return Err(ConfigError::Invalid {
                key: key.into(),
                message: format!("{value:?}: expected auto, kernel, copy-engine or staged"),
            })
        }
    })
}

impl From<umbp_ssd::InvalidSetting> for ConfigError {
    fn from(e: umbp_ssd::InvalidSetting) -> Self {
        match settings::by_flag(&e.key) {
            Some(setting) => ConfigError::Setting { setting, message: e.message },
            None => ConfigError::Invalid { key: e.key, message: e.message },
        }
    }
}

/// Parses `64GiB`, `64G`, `1.5 GiB`, `512MB`, `4096` (bytes). Binary units for both
/// spellings (`G` = `GiB`), as operators mean when sizing DRAM.
pub fn parse_size(key: &str, value: &str) -> Result<u64, ConfigError> {
    let bad = || ConfigError::BadSize { key: key.to_string(), value: value.to_string() };
    let s = value.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let num: f64 = num.parse().map_err(|_| bad())?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(bad()),
    };
    let bytes = num * mult as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 || (unit.trim().is_empty() && num.fract() != 0.0) {
        return Err(bad());
    }
    Ok(bytes as u64)
}

pub fn parse_fraction(key: &str, value: &str) -> Result<f64, ConfigError> {
    match value.trim().parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err(ConfigError::BadFraction { key: key.to_string(), value: value.to_string() }),
    }
}

/// A group name (`umbp`) or a numeric gid (`1001`), resolved now: an unknown name is an
/// error naming `key`.
pub fn parse_group(key: &str, value: &str) -> Result<u32, ConfigError> {
    let v = value.trim();
    if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
        return v.parse().map_err(|_| ConfigError::Invalid { key: key.into(), message: format!("gid {v:?} out of range") });
    }
    let unknown = || ConfigError::Invalid { key: key.into(), message: format!("no group named {v:?} (see /etc/group)") };
    let name = std::ffi::CString::new(v).map_err(|_| unknown())?;
    if v.is_empty() {
        return Err(unknown());
    }
    let mut grp: libc::group = unsafe_zeroed_group();
    let mut buf = vec![0 as libc::c_char; 16 << 10];
    let mut out: *mut libc::group = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call; `buf` is large enough for any sane entry
    // (ERANGE is reported as unknown).
    let rc = unsafe { libc::getgrnam_r(name.as_ptr(), &mut grp, buf.as_mut_ptr(), buf.len(), &mut out) };
    if rc != 0 || out.is_null() {
        return Err(unknown());
    }
    Ok(grp.gr_gid)
}

fn unsafe_zeroed_group() -> libc::group {
    // SAFETY: `libc::group` is plain data (pointers and integers); all-zero is valid.
    unsafe { std::mem::zeroed() }
}

/// `UID:NSHEX[,NSHEX...]`: the namespaces (32 hex digits at most, as the pool logs them)
/// uid may attach with.
pub fn parse_namespace_acl(key: &str, value: &str) -> Result<(u32, Vec<u128>), ConfigError> {
    let bad = |message: String| ConfigError::Invalid { key: key.into(), message };
    let (uid, list) = value.split_once(':').ok_or_else(|| bad(format!("{value:?}: expected UID:NSHEX[,NSHEX...]")))?;
    let uid: u32 = uid.trim().parse().map_err(|_| bad(format!("{uid:?} is not a numeric uid")))?;
    let mut namespaces = Vec::new();
    for ns in list.split(',') {
        let hex = ns.trim().trim_start_matches("0x");
        if hex.is_empty() || hex.len() > 32 {
            return Err(bad(format!("{ns:?} is not a namespace (1 to 32 hex digits)")));
        }
        namespaces.push(u128::from_str_radix(hex, 16).map_err(|_| bad(format!("{ns:?} is not hexadecimal")))?);
    }
    Ok((uid, namespaces))
}

/// Half of the memory available now, at least 64 MiB: a safe share on a serving node
/// where the engines need the rest.
pub fn default_capacity() -> u64 {
    let avail = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(1 << 30);
    (avail / 2).max(64 << 20) & !((2 << 20) - 1)
}

impl PoolConfig {
    /// Copy threads one attachment may occupy at once (`copy_threads_per_peer`, 0 = all
    /// but one, at least one).
    pub fn copy_threads_per_peer(&self) -> usize {
        match self.copy_threads_per_peer {
            0 => self.copy_threads.saturating_sub(1).max(1),
            n => n.min(self.copy_threads),
        }
    }

    /// Copy threads all attachments of one uid may occupy at once while `attached_uids`
    /// distinct uids are attached. No cap on a pool only its own uid (and root) may use (no
    /// `allow_uids`) while one uid is attached: a TP8 node of one tenant keeps every thread.
    /// Otherwise `(copy_threads - 1) / (attached_uids - 1)` (at least 1; `copy_threads - 1`
    /// for a lone uid): whatever the other uids' copies wait on, every uid keeps at least one
    /// thread while no more uids than copy threads are attached, and a newcomer finds one
    /// free when one uid was attached.
    pub fn copy_threads_per_uid(&self, attached_uids: usize) -> Option<usize> {
        if attached_uids <= 1 && self.allow_uids.is_empty() {
            return None;
        }
        Some((self.copy_threads.saturating_sub(1) / attached_uids.saturating_sub(1).max(1)).max(1))
    }

    /// Every check of a configuration, whichever face built it (the daemon's flags, the
    /// embedded pool's arguments, a `PoolConfig` literal): values in range, relations
    /// between them, and the SSD directories on disk. Messages name the setting and the
    /// bad value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        use settings::*;
        let inv = |setting: &'static Setting, message: String| Err(ConfigError::setting(setting, message));
        if self.capacity_bytes < PAGE_BYTES {
            return inv(&CAPACITY, format!("{} bytes is less than one 2 MiB page", self.capacity_bytes));
        }
        // Written so that NaN also fails.
        if self.low_watermark.partial_cmp(&self.high_watermark) != Some(std::cmp::Ordering::Less) {
            return inv(&LOW_WM, format!("low watermark {} must be below high watermark {}", self.low_watermark, self.high_watermark));
        }
        for (setting, v) in [(&HIGH_WM, self.high_watermark), (&LOW_WM, self.low_watermark)] {
            if !(0.0..=1.0).contains(&v) {
                return inv(setting, format!("{v} is not a fraction between 0 and 1"));
            }
        }
        if self.min_object_bytes == 0 {
            return inv(&MIN_OBJECT_SIZE, "must be positive".into());
        }
        for (setting, v) in [(&NAMESPACE_SHARE, self.namespace_share), (&LEASE_SHARE, self.lease_share)] {
            if !(v > 0.0 && v <= 1.0) {
                return inv(setting, format!("{v} is not a fraction in (0, 1]"));
            }
        }
        if self.copy_threads == 0 {
            return inv(&COPY_THREADS, "must be at least 1".into());
        }
        let l = &self.limits;
        for (setting, v) in [
            (&MAX_ATTACHMENTS, self.max_attachments as u64),
            (&MAX_ATTACHMENTS_PER_UID, l.attachments_per_uid as u64),
            (&MAX_REGISTERED_BYTES, l.registered_bytes),
            (&MAX_REGIONS, l.regions as u64),
            (&MAX_LAYOUTS, l.layouts as u64),
            (&MAX_INFLIGHT, l.inflight as u64),
            (&MAX_INFLIGHT_BYTES, l.inflight_bytes),
            (&MAX_HANDSHAKES, self.control.max_handshakes as u64),
            (&MAX_HANDSHAKES_PER_UID, self.control.handshakes_per_uid as u64),
            (&MAX_REGIONS_PER_UID, self.uid_limits.regions as u64),
            (&MAX_REGISTERED_BYTES_PER_UID, self.uid_limits.registered_bytes),
            (&MAX_LAYOUTS_PER_UID, self.uid_limits.layouts as u64),
            (&HANDSHAKE_TIMEOUT_MS, self.control.handshake_timeout.as_millis() as u64),
            (&CONTROL_TIMEOUT_MS, self.control.message_timeout.as_millis() as u64),
            (&STORE_FENCE_TIMEOUT_MS, self.store_fence_timeout.as_millis() as u64),
        ] {
            if v == 0 {
                return inv(setting, "must be at least 1".into());
            }
        }
        let hard_arena = umbp_protocol::attachment::MAX_ARENA_BYTES;
        if l.arena_bytes < self.default_arena_bytes || l.arena_bytes > hard_arena {
            return inv(
                &MAX_ARENA_BYTES,
                format!("{} must be between the default arena ({}) and {hard_arena}", l.arena_bytes, self.default_arena_bytes),
            );
        }
        let hard_sq = umbp_protocol::ring::MAX_RING_CAPACITY;
        if !l.sq_entries.is_power_of_two() || l.sq_entries < self.default_sq_entries || l.sq_entries > hard_sq {
            return inv(
                &MAX_SQ_ENTRIES,
                format!("{} must be a power of two between the default ({}) and {hard_sq}", l.sq_entries, self.default_sq_entries),
            );
        }
        if self.metrics_group.is_some() && !self.metrics_addr.as_deref().is_some_and(|a| a.trim().starts_with("unix:")) {
            return inv(&METRICS_GROUP, "only applies to --metrics-addr unix:PATH".into());
        }
        if let Some(ssd) = &self.ssd {
            ssd::validate(ssd)?;
        }
        if self.socket_path.as_os_str().len() >= 108 {
            return inv(&SOCKET, format!("{} is longer than a unix socket path may be (107 bytes)", self.socket_path.display()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
