//! `umbp-pool`: the node-local KV-cache pool daemon. The command line (clap, every flag
//! also read from its `UMBP_*` variable), logging to stderr, the prefault progress bar and
//! signal handling live here; the pool itself is the `umbp-pool` library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

mod cluster_flags;
use umbp_pool::{parse_fraction, parse_size, Pool, PoolConfig, ProgressFn};

/// The node-local KV-cache pool that LLM serving engines share.
///
/// Every flag can also be set through the environment variable named in brackets; a flag
/// on the command line wins over the environment. Logs go to stderr; set RUST_LOG
/// (e.g. RUST_LOG=umbp_pool=debug) for more.
#[derive(Parser, Debug)]
#[command(name = "umbp-pool", version, about, long_about)]
struct Args {
    /// Unix socket to listen on: a path or unix:///path (tcp:// and other schemes are refused)
    /// [default: $XDG_RUNTIME_DIR/umbp/pool.sock or /tmp/umbp/pool.sock].
    #[arg(long, env = "UMBP_STANDALONE_ADDRESS", value_name = "PATH", value_parser = parse_socket)]
    socket: Option<PathBuf>,
    /// DRAM to hold KV blocks in, e.g. 64GiB, 512MiB [default: half of available memory].
    #[arg(long, env = "UMBP_DRAM_CAPACITY", value_name = "SIZE")]
    capacity: Option<String>,
    /// Occupancy (fraction of capacity) above which the evictor starts.
    #[arg(long = "high-wm", env = "UMBP_DRAM_HIGH_WM", value_name = "FRACTION", default_value = "0.9")]
    high_wm: String,
    /// Occupancy the evictor brings the pool back down to.
    #[arg(long = "low-wm", env = "UMBP_DRAM_LOW_WM", value_name = "FRACTION", default_value = "0.7")]
    low_wm: String,
    /// Back DRAM with 2 MiB huge pages (reserve them first: /proc/sys/vm/nr_hugepages).
    #[arg(long, env = "UMBP_DRAM_USE_HUGEPAGES", value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, default_missing_value = "true")]
    hugepages: Option<bool>,
    /// Bind DRAM to this NUMA node (use the GPUs' node: nvidia-smi topo -m).
    #[arg(long = "numa-node", env = "UMBP_DRAM_NUMA_NODE", value_name = "N")]
    numa_node: Option<u32>,
    /// Fault in all DRAM at start (shows progress) so first stores are not slowed.
    #[arg(long, env = "UMBP_DRAM_PREFAULT", value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, default_missing_value = "true")]
    prefault: Option<bool>,
    /// Also allow peers running as this uid (repeatable). The pool's own uid and root are always allowed.
    #[arg(long = "allow-uid", value_name = "UID")]
    allow_uid: Vec<u32>,
    /// Smallest KV object expected; sizes the shared index (capacity / this x 2 slots).
    #[arg(long = "min-object-size", env = "UMBP_MIN_OBJECT_SIZE", value_name = "SIZE", default_value = "64KiB")]
    min_object_size: String,
    /// How long a scheduler's prefix hit protects the blocks from eviction, in ms.
    #[arg(long = "lease-ms", env = "UMBP_LEASE_MS", value_name = "MS", default_value_t = 2000)]
    lease_ms: u64,
    /// Threads that run copies [default: CPU count clamped to 2..8].
    #[arg(long = "copy-threads", env = "UMBP_COPY_THREADS", value_name = "N")]
    copy_threads: Option<usize>,
    /// Copy threads one attachment may occupy at once, so that one peer whose copies wait
    /// (e.g. on a store fence its stream never writes) cannot stall the others; its further
    /// submissions queue per peer [default: 0 = all copy threads but one].
    #[arg(long = "copy-threads-per-peer", env = "UMBP_COPY_THREADS_PER_PEER", value_name = "N", default_value_t = 0)]
    copy_threads_per_peer: usize,
    /// How long a copy thread waits for a worker's store fence (the word its stream writes
    /// once the KV is final) before the store fails; a worker that never writes it holds
    /// the copy thread this long.
    #[arg(long = "store-fence-timeout-ms", env = "UMBP_STORE_FENCE_TIMEOUT_MS", value_name = "MS", default_value_t = 30_000)]
    store_fence_timeout_ms: u64,
    /// A submission moving more than this is copied in stages of up to this size (the first
    /// 1/16 of it, each next one --copy-stage-growth of the one before, so that the first
    /// bytes move after little planning); each stage's blocks are published (stores) or
    /// released (loads) as soon as it lands, while the next stages still copy. 0 copies
    /// every submission in one piece.
    #[arg(long = "copy-stage-size", env = "UMBP_COPY_STAGE_SIZE", value_name = "SIZE", default_value = "64MiB")]
    copy_stage_size: String,
    /// Each copy stage after the first is this percentage (100-1000) of the one before, up
    /// to --copy-stage-size. A stage is planned while the ones before it copy, so the copy
    /// never waits for planning as long as planning a byte takes less than 100/PERCENT of
    /// copying it: 100 (equal stages) suits small pages, whose planning is slow, 200
    /// (doubling) needs the fewest stages. `auto` picks by each submission's page size:
    /// 104 for 4 KiB pages, 200 from 8 KiB.
    #[arg(long = "copy-stage-growth", env = "UMBP_COPY_STAGE_GROWTH", value_name = "PERCENT|auto", default_value = "auto", value_parser = parse_growth)]
    copy_stage_growth: u32,
    /// Loads from the SSD or remote tier: DRAM the pool fills ahead of the stage a load
    /// copies (its later stages, the peer's next queued loads), so that lower-tier fetches
    /// overlap the copies; at most a quarter of --capacity. 0 fetches each stage only when
    /// the copy reaches it.
    #[arg(long = "promotion-ahead", env = "UMBP_PROMOTION_AHEAD", value_name = "SIZE", default_value = "128MiB")]
    promotion_ahead: String,
    /// How long (µs, 0-1000000) the service thread and a copy thread keep polling for work
    /// after the pool's last activity before they sleep, or `auto`. Waking a sleeping thread
    /// costs tens to hundreds of µs on a VM, on every transfer that finds the pool asleep.
    /// `auto` polls 50 µs, longer (up to 2000) while work keeps arriving soon after the
    /// threads slept, as when a worker submits back to back, and shrinks back when they
    /// sleep longer than that. A fixed value longer than the engine's step (e.g. 20000)
    /// keeps the pool awake between steps, at the price of a busy core per polling thread
    /// while traffic flows (none once idle this long).
    #[arg(long = "idle-poll-us", env = "UMBP_IDLE_POLL_US", value_name = "US|auto", default_value = "auto")]
    idle_poll_us: umbp_pool::config::IdlePoll,
    /// GPU copies: streams one copy call spreads its copies over (1-16).
    #[arg(long = "copy-streams", env = "UMBP_COPY_STREAMS", value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=16), help_heading = "GPU copy engine")]
    copy_streams: u16,
    /// GPU copies: hand copies to the driver in batches (cuMemcpyBatchAsync) where it has
    /// it; false: one driver call per copy.
    #[arg(long = "copy-batch", env = "UMBP_COPY_BATCH", value_name = "BOOL", default_value = "true", action = clap::ArgAction::Set, value_parser = clap::builder::BoolishValueParser::new(), help_heading = "GPU copy engine")]
    copy_batch: bool,
    /// GPU copies: most copies per batched driver call (1-65536).
    #[arg(long = "copy-batch-max", env = "UMBP_COPY_BATCH_MAX", value_name = "N", default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..=65536), help_heading = "GPU copy engine")]
    copy_batch_max: u32,
    /// GPU copies: large copy calls enqueue each stream's share from its own thread
    /// (measured no gain on the H200).
    #[arg(long = "copy-parallel-submit", env = "UMBP_COPY_PARALLEL", value_name = "BOOL", default_value = "false", action = clap::ArgAction::Set, value_parser = clap::builder::BoolishValueParser::new(), help_heading = "GPU copy engine")]
    copy_parallel_submit: bool,
    /// GPU copies of small pages: auto (per stage the path the GPU's calibration, done at
    /// its first registration, found fastest for its page size: device staging, the
    /// kernel over PCIe or copy engines), staged (pages gathered in GPU memory by a kernel,
    /// moved by copy engines, wherever it can run), kernel (the direct kernel wherever it
    /// can run), copy-engine (never a kernel: the engine's own kernels are not slowed,
    /// small pages move slower; no calibration). docs/gpu.md "Device staging".
    #[arg(long = "copy-kernel", env = "UMBP_COPY_KERNEL", value_name = "MODE", default_value = "auto", value_parser = ["auto", "kernel", "copy-engine", "staged"], help_heading = "GPU copy engine")]
    copy_kernel: String,
    /// GPU copies: blocks (SMs) the page copy kernel runs on (0: chosen by the calibration).
    #[arg(long = "copy-kernel-blocks", env = "UMBP_COPY_KERNEL_BLOCKS", value_name = "N", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=4096), help_heading = "GPU copy engine")]
    copy_kernel_blocks: u32,
    /// GPU copies: most bytes one page copy kernel launch moves (a stage is cut into
    /// several launches); 0: one launch per stage.
    #[arg(long = "copy-kernel-launch-size", env = "UMBP_COPY_KERNEL_LAUNCH_SIZE", value_name = "SIZE", default_value = "0", help_heading = "GPU copy engine")]
    copy_kernel_launch_size: String,
    /// GPU copies: streams one large object (4 MiB+ per copy, few copies) is split over
    /// (0 or 1: no split).
    #[arg(long = "copy-split-streams", env = "UMBP_COPY_SPLIT_STREAMS", value_name = "N", default_value_t = 0, value_parser = clap::value_parser!(u16).range(0..=16), help_heading = "GPU copy engine")]
    copy_split_streams: u16,
    /// Group that owns the socket (mode 0660); its members may connect. Name or gid
    /// [default: the pool's group]. Peers must also pass the uid allow-list (--allow-uid).
    #[arg(long = "socket-group", env = "UMBP_SOCKET_GROUP", value_name = "NAME|GID", help_heading = "Isolation")]
    socket_group: Option<String>,
    /// Namespaces a uid may attach with, e.g. 1001:9f3c...,0a1b... (hex, repeatable). Once
    /// any is given, every other uid except the pool's and root is refused, loads only
    /// find blocks stored under the loader's own namespace, and each group of namespaces
    /// listed for the same uids gets its own index and event log (a peer maps only its
    /// group's).
    #[arg(long = "namespace-acl", value_name = "UID:NSHEX[,NSHEX]", help_heading = "Isolation")]
    namespace_acl: Vec<String>,
    /// Tests only: take each peer's pidfd with pidfd_open at accept (plus its start time)
    /// even where the kernel offers SO_PEERPIDFD, to exercise the older kernels' path.
    #[arg(long = "peer-pidfd-fallback", hide = true)]
    peer_pidfd_fallback: bool,
    /// Attachments the pool serves at once, all peers together.
    #[arg(long = "max-attachments", env = "UMBP_MAX_ATTACHMENTS", value_name = "N", default_value_t = 1024, help_heading = "Limits per peer")]
    max_attachments: usize,
    /// Attachments one uid may hold at once.
    #[arg(long = "max-attachments-per-uid", env = "UMBP_MAX_ATTACHMENTS_PER_UID", value_name = "N", default_value_t = 256, help_heading = "Limits per peer")]
    max_attachments_per_uid: usize,
    /// Memory one attachment may register, all regions together.
    #[arg(long = "max-registered-bytes", env = "UMBP_MAX_REGISTERED_BYTES", value_name = "SIZE", default_value = "1TiB", help_heading = "Limits per peer")]
    max_registered_bytes: String,
    /// Memory regions one attachment may register.
    #[arg(long = "max-regions", env = "UMBP_MAX_REGIONS", value_name = "N", default_value_t = 1024, help_heading = "Limits per peer")]
    max_regions: usize,
    /// KV layouts (cache groups) one attachment may register.
    #[arg(long = "max-layouts", env = "UMBP_MAX_LAYOUTS", value_name = "N", default_value_t = 1024, help_heading = "Limits per peer")]
    max_layouts: usize,
    /// Submissions one attachment may have in flight (also capped by its completion ring);
    /// more complete at once with Busy.
    #[arg(long = "max-inflight", env = "UMBP_MAX_INFLIGHT", value_name = "N", default_value_t = 1024, help_heading = "Limits per peer")]
    max_inflight: u32,
    /// Bytes one attachment's in-flight submissions may move (blocks x object size); more
    /// complete at once with Busy. A lone submission is always admitted.
    #[arg(long = "max-inflight-bytes", env = "UMBP_MAX_INFLIGHT_BYTES", value_name = "SIZE", default_value = "16GiB", help_heading = "Limits per peer")]
    max_inflight_bytes: String,
    /// Largest arena a peer may ask for in its Hello (at most 256MiB).
    #[arg(long = "max-arena-bytes", env = "UMBP_MAX_ARENA_BYTES", value_name = "SIZE", default_value = "64MiB", help_heading = "Limits per peer")]
    max_arena_bytes: String,
    /// Largest submission ring a peer may ask for in its Hello (power of two).
    #[arg(long = "max-sq-entries", env = "UMBP_MAX_SQ_ENTRIES", value_name = "N", default_value_t = 16384, help_heading = "Limits per peer")]
    max_sq_entries: u32,
    /// Share (0..1] of the index and of DRAM that one namespace may hold; above it times
    /// --high-wm the evictor evicts that namespace's own oldest objects first. 1 = no quota;
    /// on a node shared by tenants, e.g. 0.5.
    #[arg(long = "namespace-share", env = "UMBP_NAMESPACE_SHARE", value_name = "FRACTION", default_value = "1", help_heading = "Isolation")]
    namespace_share: String,
    /// Share (0..1] of DRAM that one uid's scheduler touch hints may keep leased (protected
    /// from eviction) at once; past it, that uid's oldest leases end early.
    #[arg(long = "lease-share", env = "UMBP_LEASE_SHARE", value_name = "FRACTION", default_value = "0.5", help_heading = "Isolation")]
    lease_share: String,
    /// Regions all attachments of one uid may register together [default: 4 x --max-regions].
    #[arg(long = "max-regions-per-uid", env = "UMBP_MAX_REGIONS_PER_UID", value_name = "N", help_heading = "Limits per uid")]
    max_regions_per_uid: Option<usize>,
    /// Bytes all attachments of one uid may register together [default: 4 x --max-registered-bytes].
    #[arg(long = "max-registered-bytes-per-uid", env = "UMBP_MAX_REGISTERED_BYTES_PER_UID", value_name = "SIZE", help_heading = "Limits per uid")]
    max_registered_bytes_per_uid: Option<String>,
    /// KV layouts all attachments of one uid may register together [default: 4 x --max-layouts].
    #[arg(long = "max-layouts-per-uid", env = "UMBP_MAX_LAYOUTS_PER_UID", value_name = "N", help_heading = "Limits per uid")]
    max_layouts_per_uid: Option<usize>,
    /// Handshakes in progress at once for one uid; more connections of that uid are
    /// refused at once (ResourceExhausted) until one finishes.
    #[arg(long = "max-handshakes-per-uid", env = "UMBP_MAX_HANDSHAKES_PER_UID", value_name = "N", default_value_t = 16, help_heading = "Limits per uid")]
    max_handshakes_per_uid: usize,
    /// Handshakes in progress at once, all uids together.
    #[arg(long = "max-handshakes", env = "UMBP_MAX_HANDSHAKES", value_name = "N", default_value_t = 256, help_heading = "Control plane")]
    max_handshakes: usize,
    /// A connection's whole Hello must arrive within this many ms of being accepted.
    #[arg(long = "handshake-timeout-ms", env = "UMBP_HANDSHAKE_TIMEOUT_MS", value_name = "MS", default_value_t = 2000, help_heading = "Control plane")]
    handshake_timeout_ms: u64,
    /// Each control message must be complete within this many ms of its first byte, and
    /// each reply taken by the peer within as long; otherwise the peer is detached.
    #[arg(long = "control-timeout-ms", env = "UMBP_CONTROL_TIMEOUT_MS", value_name = "MS", default_value_t = 2000, help_heading = "Control plane")]
    control_timeout_ms: u64,
    /// File descriptors kept free below RLIMIT_NOFILE for attached peers' memfds: a new
    /// connection that would eat into them is refused at once.
    #[arg(long = "fd-reserve", env = "UMBP_FD_RESERVE", value_name = "N", default_value_t = 128, help_heading = "Control plane")]
    fd_reserve: u64,
    /// Serve Prometheus metrics on GET /metrics on a unix socket, unix:PATH (mode 0600:
    /// the pool's uid and root only; 0660 with --metrics-group), or over TCP at PORT on
    /// loopback (127.0.0.1) or HOST:PORT; e.g. unix:/run/umbp/metrics.sock, 9464
    /// [default: off]. The metrics show pool-wide traffic that tenants' own reports hide:
    /// over TCP every local user can read them (and the network, for a non-loopback HOST).
    /// A bad or busy address stops the pool at start.
    #[arg(long = "metrics-addr", env = "UMBP_METRICS_ADDR", value_name = "unix:PATH|[HOST:]PORT")]
    metrics_addr: Option<String>,
    /// Group whose members may read the unix:PATH metrics socket (mode 0660), as a name or
    /// a GID [default: none, mode 0600].
    #[arg(long = "metrics-group", env = "UMBP_METRICS_GROUP", value_name = "NAME|GID")]
    metrics_group: Option<String>,
    /// A directory for the SSD tier below DRAM, one per drive (repeatable; the environment
    /// variable takes a comma-separated list). Objects evicted from DRAM that the admission
    /// policy admits are written there and loaded back from there; a restart on the same
    /// directories (same order) serves them again. Each must exist and be writable, and it
    /// and every directory above it must be owned by the pool's uid or root and not be
    /// writable by group or others unless sticky (in a sticky one, e.g. /var/tmp, the pool
    /// uses a private umbp-ssd-<uid> subdirectory) [default: no SSD tier].
    #[arg(long = "ssd-dir", env = "UMBP_SSD_DIR", value_name = "PATH", value_delimiter = ',', help_heading = "SSD tier")]
    ssd_dir: Vec<PathBuf>,
    /// Bytes of segment files all SSD directories together may hold (split evenly), e.g.
    /// 1TiB [default: half of the free space of the first directory's file system].
    #[arg(long = "ssd-capacity", env = "UMBP_SSD_CAPACITY", value_name = "SIZE", help_heading = "SSD tier")]
    ssd_capacity: Option<String>,
    /// SSD occupancy above which a write first reclaims space (compaction, then the oldest segments).
    #[arg(long = "ssd-high-watermark", env = "UMBP_SSD_HIGH_WM", value_name = "FRACTION", default_value = "0.95", help_heading = "SSD tier")]
    ssd_high_wm: String,
    /// SSD occupancy that reclaiming brings a drive back down to.
    #[arg(long = "ssd-low-watermark", env = "UMBP_SSD_LOW_WM", value_name = "FRACTION", default_value = "0.85", help_heading = "SSD tier")]
    ssd_low_wm: String,
    /// Open segment files with O_DIRECT (where the file system refuses it, e.g. tmpfs, the
    /// pool warns and uses buffered I/O); false: always buffered.
    #[arg(long = "ssd-direct-io", env = "UMBP_SSD_DIRECT_IO", value_name = "BOOL", default_value = "true", num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set, value_parser = clap::builder::BoolishValueParser::new(), help_heading = "SSD tier")]
    ssd_direct_io: bool,
    /// Which evicted objects are written to SSD: all, hit (loaded at least once), never,
    /// hit-or-young (loaded, or stored less than 60 s before eviction) or
    /// hit-or-young:SECONDS. Every write wears the drive.
    #[arg(long = "ssd-admission", env = "UMBP_SSD_ADMISSION", value_name = "POLICY", default_value = "hit-or-young", help_heading = "SSD tier")]
    ssd_admission: String,
    /// Largest SSD segment file; an object must fit in one (multiple of 4KiB).
    #[arg(long = "ssd-segment-size", env = "UMBP_SSD_SEGMENT_SIZE", value_name = "SIZE", default_value = "256MiB", help_heading = "SSD tier")]
    ssd_segment_size: String,
    /// io_uring entries (and registered buffers) per SSD directory: the I/O queue depth.
    #[arg(long = "ssd-queue-depth", env = "UMBP_SSD_QUEUE_DEPTH", value_name = "N", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096), help_heading = "SSD tier")]
    ssd_queue_depth: u32,
    /// On SIGTERM/SIGINT, write the DRAM objects the admission policy admits to SSD before
    /// exiting, for at most this many seconds, so a restart on the same directories finds
    /// them (0: off, exit at once).
    #[arg(long = "ssd-flush-on-stop", env = "UMBP_SSD_FLUSH_ON_STOP", value_name = "SECONDS", default_value = "20", help_heading = "SSD tier")]
    ssd_flush_on_stop: String,
    #[command(flatten)]
    cluster: cluster_flags::ClusterArgs,
}

/// `--copy-stage-growth`: `auto` (0) or a percentage from 100 to 1000.
fn parse_growth(s: &str) -> Result<u32, String> {
    if s == "auto" {
        return Ok(umbp_pool::config::AUTO_COPY_STAGE_GROWTH);
    }
    match s.parse::<u32>() {
        Ok(p) if (100..=1000).contains(&p) => Ok(p),
        _ => Err(format!("{s:?}: expected auto or a percentage from 100 to 1000")),
    }
}

/// The SSD tier's settings from the `--ssd-*` flags; None without `--ssd-dir`. Each
/// directory is checked now (exists, is a directory, writable) so a bad one stops the
/// pool at start with the flag and path named.
fn ssd_config(args: &Args) -> anyhow::Result<Option<umbp_ssd::SsdConfig>> {
    let dirs: Vec<PathBuf> = args.ssd_dir.iter().filter(|d| !d.as_os_str().is_empty()).cloned().collect();
    if dirs.is_empty() {
        return Ok(None);
    }
    for d in &dirs {
        check_ssd_dir(d)?;
    }
    let mut c = umbp_ssd::SsdConfig { dirs, ..Default::default() };
    c.high_watermark = parse_fraction("ssd-high-watermark (UMBP_SSD_HIGH_WM)", &args.ssd_high_wm)?;
    c.low_watermark = parse_fraction("ssd-low-watermark (UMBP_SSD_LOW_WM)", &args.ssd_low_wm)?;
    c.direct_io = args.ssd_direct_io;
    c.admission = umbp_ssd::SsdAdmission::parse("ssd-admission (UMBP_SSD_ADMISSION)", &args.ssd_admission)?;
    c.segment_bytes = parse_size("ssd-segment-size (UMBP_SSD_SEGMENT_SIZE)", &args.ssd_segment_size)?;
    c.queue_depth = args.ssd_queue_depth;
    c.flush_on_stop = parse_seconds("ssd-flush-on-stop (UMBP_SSD_FLUSH_ON_STOP)", &args.ssd_flush_on_stop)?;
    c.capacity_bytes = match &args.ssd_capacity {
        Some(v) => parse_size("ssd-capacity (UMBP_SSD_CAPACITY)", v)?,
        None => {
            let free = free_bytes(&c.dirs[0])
                .map_err(|e| anyhow::anyhow!("ssd-dir {}: statvfs: {e} (give --ssd-capacity)", c.dirs[0].display()))?;
            (free / 2).max(c.segment_bytes * c.dirs.len() as u64)
        }
    };
    Ok(Some(c))
}

/// Seconds (`20`, `2.5`, `0`) as a duration; an error names `key`.
fn parse_seconds(key: &str, value: &str) -> anyhow::Result<std::time::Duration> {
    match value.trim().parse::<f64>() {
        Ok(s) if s.is_finite() && (0.0..=86_400.0).contains(&s) => Ok(std::time::Duration::from_secs_f64(s)),
        _ => anyhow::bail!("{key}: {value:?} is not a number of seconds from 0 to 86400"),
    }
}

/// An `--ssd-dir` must exist, be a directory and be writable by the pool.
fn check_ssd_dir(d: &std::path::Path) -> anyhow::Result<()> {
    let meta = std::fs::metadata(d).map_err(|e| anyhow::anyhow!("ssd-dir {}: {e} (create the directory first)", d.display()))?;
    if !meta.is_dir() {
        anyhow::bail!("ssd-dir {}: not a directory", d.display());
    }
    let c = std::ffi::CString::new(d.as_os_str().as_encoded_bytes())
        .map_err(|_| anyhow::anyhow!("ssd-dir {}: path contains a NUL byte", d.display()))?;
    // SAFETY: a valid NUL-terminated path.
    if unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) } != 0 {
        let e = std::io::Error::last_os_error();
        anyhow::bail!("ssd-dir {}: not writable by the pool: {e}", d.display());
    }
    Ok(())
}

/// Free bytes (for unprivileged users) of the file system holding `d`.
fn free_bytes(d: &std::path::Path) -> std::io::Result<u64> {
    let c = std::ffi::CString::new(d.as_os_str().as_encoded_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: all-zero is a valid statvfs (plain integers).
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid NUL-terminated path and a valid out pointer.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// `--socket` / `UMBP_STANDALONE_ADDRESS`: a path or `unix://` address (the one parser all
/// endpoint readers share; its message names the flag and the variable).
fn parse_socket(value: &str) -> Result<PathBuf, String> {
    umbp_ipc::endpoint::parse_endpoint("socket (UMBP_STANDALONE_ADDRESS)", std::ffi::OsStr::new(value))
        .map_err(|e| e.to_string())
}

fn config_from(args: Args) -> anyhow::Result<PoolConfig> {
    let mut c = PoolConfig { ssd: ssd_config(&args)?, ..Default::default() };
    if let Some(s) = args.socket {
        c.socket_path = s;
    }
    if let Some(cap) = args.capacity {
        c.capacity_bytes = parse_size("capacity (UMBP_DRAM_CAPACITY)", &cap)?;
    }
    c.high_watermark = parse_fraction("high-wm (UMBP_DRAM_HIGH_WM)", &args.high_wm)?;
    c.low_watermark = parse_fraction("low-wm (UMBP_DRAM_LOW_WM)", &args.low_wm)?;
    c.hugepages = args.hugepages.unwrap_or(false);
    c.numa_node = args.numa_node;
    c.prefault = args.prefault.unwrap_or(false);
    c.allow_uids = args.allow_uid;
    c.min_object_bytes = parse_size("min-object-size", &args.min_object_size)?;
    c.lease = std::time::Duration::from_millis(args.lease_ms);
    if let Some(n) = args.copy_threads {
        c.copy_threads = n;
    }
    c.copy_threads_per_peer = args.copy_threads_per_peer;
    c.store_fence_timeout = std::time::Duration::from_millis(args.store_fence_timeout_ms);
    c.copy_stage_bytes = parse_size("copy-stage-size (UMBP_COPY_STAGE_SIZE)", &args.copy_stage_size)?;
    c.copy_stage_growth_percent = args.copy_stage_growth;
    c.promotion_ahead_bytes = parse_size("promotion-ahead (UMBP_PROMOTION_AHEAD)", &args.promotion_ahead)?;
    c.idle_poll = args.idle_poll_us;
    c.engine.streams = args.copy_streams.into();
    c.engine.batch = args.copy_batch;
    c.engine.batch_max = args.copy_batch_max as usize;
    c.engine.parallel_submit = args.copy_parallel_submit;
    c.engine.gather = umbp_gpu::GatherConfig {
        mode: match args.copy_kernel.as_str() {
            "kernel" => umbp_gpu::GatherMode::Kernel,
            "copy-engine" => umbp_gpu::GatherMode::CopyEngine,
            "staged" => umbp_gpu::GatherMode::Staged,
            _ => umbp_gpu::GatherMode::Auto,
        },
        blocks: args.copy_kernel_blocks,
        launch_bytes: usize::try_from(
            parse_size("copy-kernel-launch-size (UMBP_COPY_KERNEL_LAUNCH_SIZE)", &args.copy_kernel_launch_size)?,
        )
        .map_err(|_| anyhow::anyhow!("copy-kernel-launch-size (UMBP_COPY_KERNEL_LAUNCH_SIZE): too large"))?,
        split_streams: args.copy_split_streams.into(),
    };
    if let Some(g) = &args.socket_group {
        c.socket_group = Some(umbp_pool::config::parse_group("socket-group (UMBP_SOCKET_GROUP)", g)?);
    }
    c.peer_pidfd_fallback = args.peer_pidfd_fallback;
    for acl in &args.namespace_acl {
        let (uid, namespaces) = umbp_pool::config::parse_namespace_acl("namespace-acl", acl)?;
        c.namespace_acl.entry(uid).or_default().extend(namespaces);
    }
    c.max_attachments = args.max_attachments;
    let size = |key: &str, v: &str| parse_size(key, v);
    c.limits = umbp_pool::PeerLimits {
        attachments_per_uid: args.max_attachments_per_uid,
        registered_bytes: size("max-registered-bytes (UMBP_MAX_REGISTERED_BYTES)", &args.max_registered_bytes)?,
        regions: args.max_regions,
        layouts: args.max_layouts,
        inflight: args.max_inflight,
        inflight_bytes: size("max-inflight-bytes (UMBP_MAX_INFLIGHT_BYTES)", &args.max_inflight_bytes)?,
        arena_bytes: size("max-arena-bytes (UMBP_MAX_ARENA_BYTES)", &args.max_arena_bytes)?,
        sq_entries: args.max_sq_entries,
    };
    c.uid_limits = umbp_pool::UidLimits {
        regions: args.max_regions_per_uid.unwrap_or(c.limits.regions.saturating_mul(4)),
        registered_bytes: match &args.max_registered_bytes_per_uid {
            Some(v) => size("max-registered-bytes-per-uid (UMBP_MAX_REGISTERED_BYTES_PER_UID)", v)?,
            None => c.limits.registered_bytes.saturating_mul(4),
        },
        layouts: args.max_layouts_per_uid.unwrap_or(c.limits.layouts.saturating_mul(4)),
    };
    c.control = umbp_pool::ControlLimits {
        handshake_timeout: std::time::Duration::from_millis(args.handshake_timeout_ms),
        message_timeout: std::time::Duration::from_millis(args.control_timeout_ms),
        max_handshakes: args.max_handshakes,
        handshakes_per_uid: args.max_handshakes_per_uid,
        fd_reserve: args.fd_reserve,
    };
    c.metrics_addr = args.metrics_addr.filter(|a| !a.is_empty());
    if let Some(g) = args.metrics_group.as_deref().filter(|g| !g.is_empty()) {
        if !c.metrics_addr.as_deref().is_some_and(|a| a.trim().starts_with("unix:")) {
            anyhow::bail!("metrics-group (UMBP_METRICS_GROUP): only applies to --metrics-addr unix:PATH");
        }
        c.metrics_group = Some(umbp_pool::config::parse_group("metrics-group (UMBP_METRICS_GROUP)", g)?);
    }
    c.namespace_share = parse_fraction("namespace-share (UMBP_NAMESPACE_SHARE)", &args.namespace_share)?;
    c.lease_share = parse_fraction("lease-share (UMBP_LEASE_SHARE)", &args.lease_share)?;
    c.validate()?;
    c.progress = Some(progress_bar());
    Ok(c)
}

/// Blocks SIGINT/SIGTERM in every thread and returns when one arrives.
/// Draws the prefault progress on stderr (hidden when stderr is not a terminal).
fn progress_bar() -> ProgressFn {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg} {bar:40} {bytes}/{total_bytes} ({eta})").expect("static template"),
    );
    ProgressFn::new(move |p| {
        bar.set_message(p.what);
        bar.set_length(p.total_bytes);
        bar.set_position(p.done_bytes);
        if p.done_bytes >= p.total_bytes {
            bar.finish_and_clear();
        }
    })
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let cluster = match args.cluster.config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("umbp-pool: {e:#}");
            return ExitCode::from(2);
        }
    };
    let config = match config_from(args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("umbp-pool: {e:#}");
            return ExitCode::from(2);
        }
    };
    if umbp_pool::FAULT_INJECTION {
        tracing::warn!("this umbp-pool was built with the umbp-pool library's fault-injection feature (a test build); build it alone (`cargo build --release -p umbp-pool-daemon`) for production");
    }
    if config.ssd.is_some() {
        // A segment write past RLIMIT_FSIZE must fail with EFBIG (the object is not
        // stored, docs/ssd.md) instead of killing the pool with SIGXFSZ.
        // SAFETY: setting a signal's disposition to ignore has no memory preconditions.
        unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    }
    // Before any thread starts, so all inherit the mask and only the wait below sees it.
    let stop = umbp_pool::StopSignals::block();
    // PoolError's message carries its cause already: print it once, not the chain.
    let pool = match Pool::start(config) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("umbp-pool: {e}");
            return ExitCode::from(1);
        }
    };
    let tier = match cluster.map(|(c, peers, opts)| cluster_flags::start(&pool, c, peers, opts)).transpose() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("umbp-pool: {e:#}");
            pool.shutdown();
            return ExitCode::from(1);
        }
    };
    let sig = stop.wait();
    tracing::info!(signal = sig, "shutting down");
    drop(tier);
    pool.shutdown();
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The GPU copy engine's flags (and, through clap, their env vars) reach the config
    /// passed to the pool; out-of-range values are refused naming the flag.
    #[test]
    fn copy_engine_flags_reach_the_config() {
        let parse = |extra: &[&str]| Args::try_parse_from(["umbp-pool"].iter().chain(extra));
        let c = config_from(
            parse(&["--copy-streams", "4", "--copy-batch", "0", "--copy-batch-max", "64", "--copy-parallel-submit", "1"]).unwrap(),
        )
        .unwrap();
        assert_eq!((c.engine.streams, c.engine.batch, c.engine.batch_max, c.engine.parallel_submit), (4, false, 64, true));
        let g = config_from(parse(&[]).unwrap()).unwrap().engine.gather;
        assert_eq!(g, umbp_gpu::GatherConfig::default(), "page copy kernel defaults");
        let growth = |extra: &[&str]| config_from(parse(extra).unwrap()).unwrap().copy_stage_growth_percent;
        assert_eq!(growth(&[]), umbp_pool::config::AUTO_COPY_STAGE_GROWTH, "auto by default");
        assert_eq!(growth(&["--copy-stage-growth", "auto"]), umbp_pool::config::AUTO_COPY_STAGE_GROWTH);
        assert_eq!(growth(&["--copy-stage-growth", "125"]), 125);
        let poll = |extra: &[&str]| config_from(parse(extra).unwrap()).unwrap().idle_poll;
        assert_eq!(poll(&[]), umbp_pool::config::DEFAULT_IDLE_POLL);
        assert_eq!(poll(&["--idle-poll-us", "auto"]), umbp_pool::config::IdlePoll::Auto { max: umbp_pool::config::AUTO_IDLE_POLL_MAX });
        assert_eq!(poll(&["--idle-poll-us", "20000"]), umbp_pool::config::IdlePoll::Fixed(std::time::Duration::from_millis(20)));
        assert_eq!(poll(&["--idle-poll-us", "0"]), umbp_pool::config::IdlePoll::Fixed(std::time::Duration::ZERO));
        let g = config_from(
            parse(&["--copy-kernel", "copy-engine", "--copy-kernel-blocks", "12", "--copy-kernel-launch-size", "4MiB", "--copy-split-streams", "4"]).unwrap(),
        )
        .unwrap()
        .engine
        .gather;
        assert_eq!((g.mode, g.blocks, g.launch_bytes, g.split_streams), (umbp_gpu::GatherMode::CopyEngine, 12, 4 << 20, 4));
        let g = config_from(parse(&["--copy-kernel", "kernel"]).unwrap()).unwrap().engine.gather;
        assert_eq!(g.mode, umbp_gpu::GatherMode::Kernel);
        let g = config_from(parse(&["--copy-kernel", "staged"]).unwrap()).unwrap().engine.gather;
        assert_eq!(g.mode, umbp_gpu::GatherMode::Staged);
        assert!(parse(&["--copy-kernel", "stage"]).is_err(), "an unknown mode is refused");
        let err = config_from(parse(&["--copy-kernel-launch-size", "lots"]).unwrap()).unwrap_err().to_string();
        assert!(err.contains("copy-kernel-launch-size"), "{err}");
        for bad in [
            ["--copy-streams", "0"],
            ["--copy-streams", "17"],
            ["--copy-batch-max", "0"],
            ["--copy-batch", "maybe"],
            ["--copy-kernel", "gpu"],
            ["--copy-split-streams", "17"],
            ["--copy-stage-growth", "99"],
            ["--copy-stage-growth", "1001"],
            ["--copy-stage-growth", "fast"],
            ["--idle-poll-us", "1000001"],
            ["--idle-poll-us", "1ms"],
            ["--idle-poll-us", "1.5"],
            ["--idle-poll-us", "Auto"],
        ] {
            let err = parse(&bad).unwrap_err().to_string();
            assert!(err.contains(bad[0]), "{bad:?}: {err}");
        }
    }

    /// The SSD flags reach the config; a missing directory, a file, a read-only directory
    /// and bad values are refused naming the flag and the path.
    #[test]
    fn ssd_flags_reach_the_config_and_bad_dirs_are_named() {
        let parse = |extra: &[&str]| Args::try_parse_from(["umbp-pool"].iter().chain(extra));
        assert!(config_from(parse(&[]).unwrap()).unwrap().ssd.is_none());
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let (pa, pb) = (a.path().to_str().unwrap(), b.path().to_str().unwrap());
        let c = config_from(
            parse(&[
                "--ssd-dir", pa, "--ssd-dir", pb, "--ssd-capacity", "2GiB", "--ssd-high-watermark", "0.9",
                "--ssd-low-watermark", "0.5", "--ssd-direct-io", "false", "--ssd-admission", "hit-or-young:5",
                "--ssd-segment-size", "64MiB", "--ssd-queue-depth", "32", "--ssd-flush-on-stop", "2.5",
            ])
            .unwrap(),
        )
        .unwrap()
        .ssd
        .unwrap();
        assert_eq!(c.dirs, vec![a.path().to_path_buf(), b.path().to_path_buf()]);
        assert_eq!((c.capacity_bytes, c.high_watermark, c.low_watermark, c.direct_io), (2 << 30, 0.9, 0.5, false));
        assert_eq!((c.segment_bytes, c.queue_depth, c.flush_on_stop), (64 << 20, 32, std::time::Duration::from_millis(2500)));
        assert_eq!(c.admission, umbp_ssd::SsdAdmission::HitOrYoung { young: std::time::Duration::from_secs(5) });
        // Defaults: capacity from the free space, admission hit-or-young.
        let c = config_from(parse(&["--ssd-dir", pa]).unwrap()).unwrap().ssd.unwrap();
        assert!(c.capacity_bytes >= 256 << 20 && c.direct_io);
        assert_eq!(c.admission, umbp_ssd::SsdAdmission::default());
        assert_eq!(c.flush_on_stop, umbp_ssd::DEFAULT_FLUSH_ON_STOP);
        let err = |extra: &[&str]| config_from(parse(extra).unwrap()).unwrap_err().to_string();
        for bad in ["-1", "soon", "1e9"] {
            let e = err(&["--ssd-dir", pa, &format!("--ssd-flush-on-stop={bad}")]);
            assert!(e.contains("ssd-flush-on-stop") && e.contains(bad), "{e}");
        }
        let missing = a.path().join("nope");
        let e = err(&["--ssd-dir", missing.to_str().unwrap()]);
        assert!(e.contains("ssd-dir") && e.contains(missing.to_str().unwrap()) && e.contains("No such file"), "{e}");
        let file = a.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        let e = err(&["--ssd-dir", file.to_str().unwrap()]);
        assert!(e.contains("ssd-dir") && e.contains("not a directory"), "{e}");
        let e = err(&["--ssd-dir", pa, "--ssd-admission", "sometimes"]);
        assert!(e.contains("ssd-admission"), "{e}");
        let e = err(&["--ssd-dir", pa, "--ssd-capacity", "1MiB"]);
        assert!(e.contains("ssd-capacity"), "{e}");
        let e = err(&["--ssd-dir", pa, "--ssd-capacity", "1GiB", "--ssd-high-watermark", "0.5", "--ssd-low-watermark", "0.8"]);
        assert!(e.contains("ssd-low-watermark"), "{e}");
        // Read-only: only observable when not root (root writes anyway).
        let ro = b.path().join("ro");
        std::fs::create_dir(&ro).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            let e = err(&["--ssd-dir", ro.to_str().unwrap()]);
            assert!(e.contains("ssd-dir") && e.contains("not writable"), "{e}");
        } else {
            eprintln!("skipped: read-only directory check (running as root)");
        }
        // The environment's comma-separated list.
        let c = Args::try_parse_from(["umbp-pool", "--ssd-dir", &format!("{pa},{pb}"), "--ssd-capacity", "1GiB"]).unwrap();
        assert_eq!(config_from(c).unwrap().ssd.unwrap().dirs.len(), 2);
    }
}
