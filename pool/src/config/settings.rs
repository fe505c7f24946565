//! The one table of pool settings. Each row is one setting as every face spells it: the
//! daemon's flag and environment variable, the embedded pool's keyword argument (`name`),
//! the default and the help text. `PoolConfig::default()` reads its defaults from here, the
//! daemon builds its clap arguments from here, and the Python binding hands the table to
//! `umbp.vllm.config` (`umbp._native.pool_settings()`), so a value is written once.

/// One pool setting.
#[derive(Debug, PartialEq, Eq)]
pub struct Setting {
    /// The embedded pool's keyword argument; errors name it to Python callers.
    pub name: &'static str,
    /// The value's form, shown as the flag's value name (`SIZE`, `FRACTION`, `N`, `MS`).
    pub kind: &'static str,
    /// The default as the flag takes it; None: unset, and `help` says what unset means.
    pub default: Option<&'static str>,
    /// The environment variable the daemon also reads it from (the flag wins).
    pub env: Option<&'static str>,
    /// The daemon's long flag, without its dashes; errors name it to the daemon's users.
    pub flag: &'static str,
    pub help: &'static str,
    /// The section of `umbp-pool --help`; None: the first one.
    pub heading: Option<&'static str>,
}

impl Setting {
    /// How the daemon's errors name it: `flag (ENV)`.
    pub fn label(&self) -> String {
        match self.env {
            Some(env) => format!("{} ({env})", self.flag),
            None => self.flag.to_string(),
        }
    }

    /// The default; panics for a setting without one (a table bug, caught by its tests).
    pub fn default_str(&self) -> &'static str {
        self.default.unwrap_or_else(|| panic!("setting {} has no default", self.name))
    }
}

const GPU: Option<&str> = Some("GPU copy engine");
const ISOLATION: Option<&str> = Some("Isolation");
const PER_PEER: Option<&str> = Some("Limits per peer");
const PER_UID: Option<&str> = Some("Limits per uid");
const CONTROL: Option<&str> = Some("Control plane");
const SSD: Option<&str> = Some("SSD tier");
const CLUSTER: Option<&str> = Some("Cluster (docs/cluster.md)");

macro_rules! settings {
    ($($id:ident { $($field:ident: $value:expr),* $(,)? })*) => {
        $(pub const $id: Setting = Setting { $($field: $value),* };)*
        /// Every row, in `--help` order.
        pub const ALL: &[&Setting] = &[$(&$id),*];
    };
}

settings! {
    SOCKET { name: "socket_path", kind: "PATH", default: None, env: Some("UMBP_STANDALONE_ADDRESS"), flag: "socket", heading: None,
        help: "Unix socket to listen on: a path or unix:///path (tcp:// and other schemes are refused) [default: $XDG_RUNTIME_DIR/umbp/pool.sock or /tmp/umbp/pool.sock]" }
    CAPACITY { name: "capacity_bytes", kind: "SIZE", default: None, env: Some("UMBP_DRAM_CAPACITY"), flag: "capacity", heading: None,
        help: "DRAM to hold KV blocks in, e.g. 64GiB, 512MiB [default: half of available memory]" }
    HIGH_WM { name: "high_wm", kind: "FRACTION", default: Some("0.9"), env: Some("UMBP_DRAM_HIGH_WM"), flag: "high-wm", heading: None,
        help: "Occupancy (fraction of capacity) above which the evictor starts" }
    LOW_WM { name: "low_wm", kind: "FRACTION", default: Some("0.7"), env: Some("UMBP_DRAM_LOW_WM"), flag: "low-wm", heading: None,
        help: "Occupancy the evictor brings the pool back down to" }
    HUGEPAGES { name: "hugepages", kind: "BOOL", default: Some("false"), env: Some("UMBP_DRAM_USE_HUGEPAGES"), flag: "hugepages", heading: None,
        help: "Back DRAM with 2 MiB huge pages (reserve them first: /proc/sys/vm/nr_hugepages)" }
    NUMA_NODE { name: "numa_node", kind: "N", default: None, env: Some("UMBP_DRAM_NUMA_NODE"), flag: "numa-node", heading: None,
        help: "Bind DRAM to this NUMA node (use the GPUs' node: nvidia-smi topo -m)" }
    PREFAULT { name: "prefault", kind: "BOOL", default: Some("false"), env: Some("UMBP_DRAM_PREFAULT"), flag: "prefault", heading: None,
        help: "Fault in all DRAM at start (shows progress) so first stores are not slowed" }
    ALLOW_UID { name: "allow_uid", kind: "UID", default: None, env: None, flag: "allow-uid", heading: None,
        help: "Also allow peers running as this uid (repeatable). The pool's own uid and root are always allowed" }
    MIN_OBJECT_SIZE { name: "min_object_bytes", kind: "SIZE", default: Some("64KiB"), env: Some("UMBP_MIN_OBJECT_SIZE"), flag: "min-object-size", heading: None,
        help: "Smallest KV object expected; sizes the shared index (capacity / this x 2 slots)" }
    LEASE_MS { name: "lease_ms", kind: "MS", default: Some("2000"), env: Some("UMBP_LEASE_MS"), flag: "lease-ms", heading: None,
        help: "How long a scheduler's prefix hit protects the blocks from eviction, in ms" }
    COPY_THREADS { name: "copy_threads", kind: "N", default: None, env: Some("UMBP_COPY_THREADS"), flag: "copy-threads", heading: None,
        help: "Threads that run copies [default: CPU count clamped to 2..8]" }
    COPY_THREADS_PER_PEER { name: "copy_threads_per_peer", kind: "N", default: Some("0"), env: Some("UMBP_COPY_THREADS_PER_PEER"), flag: "copy-threads-per-peer", heading: None,
        help: "Copy threads one attachment may occupy at once, so that one peer whose copies wait (e.g. on a store fence its stream never writes) cannot stall the others; its further submissions queue per peer (0 = all copy threads but one)" }
    STORE_FENCE_TIMEOUT_MS { name: "store_fence_timeout_ms", kind: "MS", default: Some("30000"), env: Some("UMBP_STORE_FENCE_TIMEOUT_MS"), flag: "store-fence-timeout-ms", heading: None,
        help: "How long a copy thread waits for a worker's store fence (the word its stream writes once the KV is final) before the store fails; a worker that never writes it holds the copy thread this long" }
    COPY_STAGE_SIZE { name: "copy_stage_bytes", kind: "SIZE", default: Some("64MiB"), env: Some("UMBP_COPY_STAGE_SIZE"), flag: "copy-stage-size", heading: None,
        help: "A submission moving more than this is copied in stages of up to this size (the first 1/16 of it, each next one --copy-stage-growth of the one before, so that the first bytes move after little planning); each stage's blocks are published (stores) or released (loads) as soon as it lands, while the next stages still copy. 0 copies every submission in one piece" }
    COPY_STAGE_GROWTH { name: "copy_stage_growth", kind: "PERCENT|auto", default: Some("auto"), env: Some("UMBP_COPY_STAGE_GROWTH"), flag: "copy-stage-growth", heading: None,
        help: "Each copy stage after the first is this percentage (100-1000) of the one before, up to --copy-stage-size. A stage is planned while the ones before it copy, so the copy never waits for planning as long as planning a byte takes less than 100/PERCENT of copying it: 100 (equal stages) suits small pages, whose planning is slow, 200 (doubling) needs the fewest stages. `auto` picks by each submission's page size: 104 for 4 KiB pages, 200 from 8 KiB" }
    PROMOTION_AHEAD { name: "promotion_ahead_bytes", kind: "SIZE", default: Some("128MiB"), env: Some("UMBP_PROMOTION_AHEAD"), flag: "promotion-ahead", heading: None,
        help: "Loads from the SSD or remote tier: DRAM the pool fills ahead of the stage a load copies (its later stages, the peer's next queued loads), so that lower-tier fetches overlap the copies; at most a quarter of --capacity. 0 fetches each stage only when the copy reaches it" }
    QUARANTINE_MAX_SIZE { name: "quarantine_max_bytes", kind: "SIZE", default: None, env: Some("UMBP_QUARANTINE_MAX_SIZE"), flag: "quarantine-max-size", heading: None,
        help: "DRAM held in quarantine at most: ranges a remote read that timed out may still write are kept out of use until the read is known finished or the peer is gone (counted, `quarantined_bytes`); at the bound, promotions from the remote tier are misses (recompute) until ranges are reclaimed [default: 1/8 of --capacity]" }
    IDLE_POLL_US { name: "idle_poll_us", kind: "US|auto", default: Some("auto"), env: Some("UMBP_IDLE_POLL_US"), flag: "idle-poll-us", heading: None,
        help: "How long (µs, 0-1000000) the service thread and a copy thread keep polling for work after the pool's last activity before they sleep, or `auto`. Waking a sleeping thread costs tens to hundreds of µs on a VM, on every transfer that finds the pool asleep. `auto` polls 50 µs, longer (up to 2000) while work keeps arriving soon after the threads slept, as when a worker submits back to back, and shrinks back when they sleep longer than that. A fixed value longer than the engine's step (e.g. 20000) keeps the pool awake between steps, at the price of a busy core per polling thread while traffic flows (none once idle this long)" }
    COPY_STREAMS { name: "copy_streams", kind: "N", default: Some("1"), env: Some("UMBP_COPY_STREAMS"), flag: "copy-streams", heading: GPU,
        help: "GPU copies: streams one copy call spreads its copies over (1-16)" }
    COPY_BATCH { name: "copy_batch", kind: "BOOL", default: Some("true"), env: Some("UMBP_COPY_BATCH"), flag: "copy-batch", heading: GPU,
        help: "GPU copies: hand copies to the driver in batches (cuMemcpyBatchAsync) where it has it; false: one driver call per copy" }
    COPY_BATCH_MAX { name: "copy_batch_max", kind: "N", default: Some("512"), env: Some("UMBP_COPY_BATCH_MAX"), flag: "copy-batch-max", heading: GPU,
        help: "GPU copies: most copies per batched driver call (1-65536)" }
    COPY_PARALLEL_SUBMIT { name: "copy_parallel_submit", kind: "BOOL", default: Some("false"), env: Some("UMBP_COPY_PARALLEL"), flag: "copy-parallel-submit", heading: GPU,
        help: "GPU copies: large copy calls enqueue each stream's share from its own thread (measured no gain on the H200)" }
    COPY_KERNEL { name: "copy_kernel", kind: "MODE", default: Some("auto"), env: Some("UMBP_COPY_KERNEL"), flag: "copy-kernel", heading: GPU,
        help: "GPU copies of small pages: auto (per stage the path the GPU's calibration, done at its first registration, found fastest for its page size: device staging, the kernel over PCIe or copy engines), staged (pages gathered in GPU memory by a kernel, moved by copy engines, wherever it can run), kernel (the direct kernel wherever it can run), copy-engine (never a kernel: the engine's own kernels are not slowed, small pages move slower; no calibration). docs/gpu.md \"Device staging\"" }
    COPY_KERNEL_BLOCKS { name: "copy_kernel_blocks", kind: "N", default: Some("0"), env: Some("UMBP_COPY_KERNEL_BLOCKS"), flag: "copy-kernel-blocks", heading: GPU,
        help: "GPU copies: blocks (SMs) the page copy kernel runs on (0: chosen by the calibration)" }
    COPY_KERNEL_LAUNCH_SIZE { name: "copy_kernel_launch_bytes", kind: "SIZE", default: Some("0"), env: Some("UMBP_COPY_KERNEL_LAUNCH_SIZE"), flag: "copy-kernel-launch-size", heading: GPU,
        help: "GPU copies: most bytes one page copy kernel launch moves (a stage is cut into several launches); 0: one launch per stage" }
    COPY_SPLIT_STREAMS { name: "copy_split_streams", kind: "N", default: Some("0"), env: Some("UMBP_COPY_SPLIT_STREAMS"), flag: "copy-split-streams", heading: GPU,
        help: "GPU copies: streams one large object (4 MiB+ per copy, few copies) is split over (0 or 1: no split)" }
    SOCKET_GROUP { name: "socket_group", kind: "NAME|GID", default: None, env: Some("UMBP_SOCKET_GROUP"), flag: "socket-group", heading: ISOLATION,
        help: "Group that owns the socket (mode 0660); its members may connect. Name or gid [default: the pool's group]. Peers must also pass the uid allow-list (--allow-uid)" }
    NAMESPACE_ACL { name: "namespace_acl", kind: "UID:NSHEX[,NSHEX]", default: None, env: None, flag: "namespace-acl", heading: ISOLATION,
        help: "Namespaces a uid may attach with, e.g. 1001:9f3c...,0a1b... (hex, repeatable). Once any is given, every other uid except the pool's and root is refused, loads only find blocks stored under the loader's own namespace, and each group of namespaces listed for the same uids gets its own index and event log (a peer maps only its group's)" }
    PEER_PIDFD_FALLBACK { name: "peer_pidfd_fallback", kind: "BOOL", default: Some("false"), env: None, flag: "peer-pidfd-fallback", heading: None,
        help: "Tests only: take each peer's pidfd with pidfd_open at accept (plus its start time) even where the kernel offers SO_PEERPIDFD, to exercise the older kernels' path" }
    MAX_ATTACHMENTS { name: "max_attachments", kind: "N", default: Some("1024"), env: Some("UMBP_MAX_ATTACHMENTS"), flag: "max-attachments", heading: PER_PEER,
        help: "Attachments the pool serves at once, all peers together" }
    MAX_ATTACHMENTS_PER_UID { name: "max_attachments_per_uid", kind: "N", default: Some("256"), env: Some("UMBP_MAX_ATTACHMENTS_PER_UID"), flag: "max-attachments-per-uid", heading: PER_PEER,
        help: "Attachments one uid may hold at once" }
    MAX_REGISTERED_BYTES { name: "max_registered_bytes", kind: "SIZE", default: Some("1TiB"), env: Some("UMBP_MAX_REGISTERED_BYTES"), flag: "max-registered-bytes", heading: PER_PEER,
        help: "Memory one attachment may register, all regions together" }
    MAX_REGIONS { name: "max_regions", kind: "N", default: Some("1024"), env: Some("UMBP_MAX_REGIONS"), flag: "max-regions", heading: PER_PEER,
        help: "Memory regions one attachment may register" }
    MAX_LAYOUTS { name: "max_layouts", kind: "N", default: Some("1024"), env: Some("UMBP_MAX_LAYOUTS"), flag: "max-layouts", heading: PER_PEER,
        help: "KV layouts (cache groups) one attachment may register" }
    MAX_INFLIGHT { name: "max_inflight", kind: "N", default: Some("1024"), env: Some("UMBP_MAX_INFLIGHT"), flag: "max-inflight", heading: PER_PEER,
        help: "Submissions one attachment may have in flight (also capped by its completion ring); more complete at once with Busy" }
    MAX_INFLIGHT_BYTES { name: "max_inflight_bytes", kind: "SIZE", default: Some("16GiB"), env: Some("UMBP_MAX_INFLIGHT_BYTES"), flag: "max-inflight-bytes", heading: PER_PEER,
        help: "Bytes one attachment's in-flight submissions may move (blocks x object size); more complete at once with Busy. A lone submission is always admitted" }
    MAX_ARENA_BYTES { name: "max_arena_bytes", kind: "SIZE", default: Some("64MiB"), env: Some("UMBP_MAX_ARENA_BYTES"), flag: "max-arena-bytes", heading: PER_PEER,
        help: "Largest arena a peer may ask for in its Hello (at most 256MiB)" }
    MAX_SQ_ENTRIES { name: "max_sq_entries", kind: "N", default: Some("16384"), env: Some("UMBP_MAX_SQ_ENTRIES"), flag: "max-sq-entries", heading: PER_PEER,
        help: "Largest submission ring a peer may ask for in its Hello (power of two)" }
    NAMESPACE_SHARE { name: "namespace_share", kind: "FRACTION", default: Some("1"), env: Some("UMBP_NAMESPACE_SHARE"), flag: "namespace-share", heading: ISOLATION,
        help: "Share (0..1] of the index and of DRAM that one namespace may hold; above it times --high-wm the evictor evicts that namespace's own oldest objects first. 1 = no quota; on a node shared by tenants, e.g. 0.5" }
    LEASE_SHARE { name: "lease_share", kind: "FRACTION", default: Some("0.5"), env: Some("UMBP_LEASE_SHARE"), flag: "lease-share", heading: ISOLATION,
        help: "Share (0..1] of DRAM that one uid's scheduler touch hints may keep leased (protected from eviction) at once; past it, that uid's oldest leases end early" }
    MAX_REGIONS_PER_UID { name: "max_regions_per_uid", kind: "N", default: None, env: Some("UMBP_MAX_REGIONS_PER_UID"), flag: "max-regions-per-uid", heading: PER_UID,
        help: "Regions all attachments of one uid may register together [default: 4 x --max-regions]" }
    MAX_REGISTERED_BYTES_PER_UID { name: "max_registered_bytes_per_uid", kind: "SIZE", default: None, env: Some("UMBP_MAX_REGISTERED_BYTES_PER_UID"), flag: "max-registered-bytes-per-uid", heading: PER_UID,
        help: "Bytes all attachments of one uid may register together [default: 4 x --max-registered-bytes]" }
    MAX_LAYOUTS_PER_UID { name: "max_layouts_per_uid", kind: "N", default: None, env: Some("UMBP_MAX_LAYOUTS_PER_UID"), flag: "max-layouts-per-uid", heading: PER_UID,
        help: "KV layouts all attachments of one uid may register together [default: 4 x --max-layouts]" }
    MAX_HANDSHAKES_PER_UID { name: "max_handshakes_per_uid", kind: "N", default: Some("16"), env: Some("UMBP_MAX_HANDSHAKES_PER_UID"), flag: "max-handshakes-per-uid", heading: PER_UID,
        help: "Handshakes in progress at once for one uid; more connections of that uid are refused at once (ResourceExhausted) until one finishes" }
    MAX_HANDSHAKES { name: "max_handshakes", kind: "N", default: Some("256"), env: Some("UMBP_MAX_HANDSHAKES"), flag: "max-handshakes", heading: CONTROL,
        help: "Handshakes in progress at once, all uids together" }
    HANDSHAKE_TIMEOUT_MS { name: "handshake_timeout_ms", kind: "MS", default: Some("2000"), env: Some("UMBP_HANDSHAKE_TIMEOUT_MS"), flag: "handshake-timeout-ms", heading: CONTROL,
        help: "A connection's whole Hello must arrive within this many ms of being accepted" }
    CONTROL_TIMEOUT_MS { name: "control_timeout_ms", kind: "MS", default: Some("2000"), env: Some("UMBP_CONTROL_TIMEOUT_MS"), flag: "control-timeout-ms", heading: CONTROL,
        help: "Each control message must be complete within this many ms of its first byte, and each reply taken by the peer within as long; otherwise the peer is detached" }
    FD_RESERVE { name: "fd_reserve", kind: "N", default: Some("128"), env: Some("UMBP_FD_RESERVE"), flag: "fd-reserve", heading: CONTROL,
        help: "File descriptors kept free below RLIMIT_NOFILE for attached peers' memfds: a new connection that would eat into them is refused at once" }
    METRICS_ADDR { name: "metrics_addr", kind: "unix:PATH|[HOST:]PORT", default: None, env: Some("UMBP_METRICS_ADDR"), flag: "metrics-addr", heading: None,
        help: "Serve Prometheus metrics on GET /metrics on a unix socket, unix:PATH (mode 0600: the pool's uid and root only; 0660 with --metrics-group), or over TCP at PORT on loopback (127.0.0.1) or HOST:PORT; e.g. unix:/run/umbp/metrics.sock, 9464 [default: off]. The metrics show pool-wide traffic that tenants' own reports hide: over TCP every local user can read them (and the network, for a non-loopback HOST). A bad or busy address stops the pool at start" }
    METRICS_GROUP { name: "metrics_group", kind: "NAME|GID", default: None, env: Some("UMBP_METRICS_GROUP"), flag: "metrics-group", heading: None,
        help: "Group whose members may read the unix:PATH metrics socket (mode 0660), as a name or a GID [default: none, mode 0600]" }
    SSD_DIR { name: "ssd_dir", kind: "PATH", default: None, env: Some("UMBP_SSD_DIR"), flag: "ssd-dir", heading: SSD,
        help: "A directory for the SSD tier below DRAM, one per drive (repeatable; the environment variable takes a comma-separated list). Objects evicted from DRAM that the admission policy admits are written there and loaded back from there; a restart on the same directories (same order) serves them again. Each must exist and be writable, and it and every directory above it must be owned by the pool's uid or root and not be writable by group or others unless sticky (in a sticky one, e.g. /var/tmp, the pool uses a private umbp-ssd-<uid> subdirectory) [default: no SSD tier]" }
    SSD_CAPACITY { name: "ssd_capacity", kind: "SIZE", default: None, env: Some("UMBP_SSD_CAPACITY"), flag: "ssd-capacity", heading: SSD,
        help: "Bytes of segment files all SSD directories together may hold (split evenly), e.g. 1TiB [default: half of the free space of the first directory's file system, at least one segment per directory]" }
    SSD_HIGH_WM { name: "ssd_high_wm", kind: "FRACTION", default: Some("0.95"), env: Some("UMBP_SSD_HIGH_WM"), flag: "ssd-high-watermark", heading: SSD,
        help: "SSD occupancy above which a write first reclaims space (compaction, then the oldest segments)" }
    SSD_LOW_WM { name: "ssd_low_wm", kind: "FRACTION", default: Some("0.85"), env: Some("UMBP_SSD_LOW_WM"), flag: "ssd-low-watermark", heading: SSD,
        help: "SSD occupancy that reclaiming brings a drive back down to" }
    SSD_DIRECT_IO { name: "ssd_direct_io", kind: "BOOL", default: Some("true"), env: Some("UMBP_SSD_DIRECT_IO"), flag: "ssd-direct-io", heading: SSD,
        help: "Open segment files with O_DIRECT (where the file system refuses it, e.g. tmpfs, the pool warns and uses buffered I/O); false: always buffered" }
    SSD_ADMISSION { name: "ssd_admission", kind: "POLICY", default: Some("hit-or-young"), env: Some("UMBP_SSD_ADMISSION"), flag: "ssd-admission", heading: SSD,
        help: "Which evicted objects are written to SSD: all, hit (loaded at least once), never, hit-or-young (loaded, or stored less than 60 s before eviction) or hit-or-young:SECONDS. Every write wears the drive" }
    SSD_SEGMENT_SIZE { name: "ssd_segment_bytes", kind: "SIZE", default: None, env: Some("UMBP_SSD_SEGMENT_SIZE"), flag: "ssd-segment-size", heading: SSD,
        help: "Largest SSD segment file; an object must fit in one (multiple of 4KiB) [default: 256MiB, or a quarter of the capacity per directory (whole MiB, at least 1MiB) where that is less]" }
    SSD_QUEUE_DEPTH { name: "ssd_queue_depth", kind: "N", default: Some("64"), env: Some("UMBP_SSD_QUEUE_DEPTH"), flag: "ssd-queue-depth", heading: SSD,
        help: "io_uring entries (and registered buffers) per SSD directory: the I/O queue depth" }
    SSD_FLUSH_ON_STOP { name: "ssd_flush_on_stop", kind: "SECONDS", default: Some("20"), env: Some("UMBP_SSD_FLUSH_ON_STOP"), flag: "ssd-flush-on-stop", heading: SSD,
        help: "On SIGTERM/SIGINT, write the DRAM objects the admission policy admits to SSD before exiting, for at most this many seconds, so a restart on the same directories finds them (0: off, exit at once)" }
    SSD_SYNC_INTERVAL { name: "ssd_sync_interval", kind: "SECONDS", default: Some("0"), env: Some("UMBP_SSD_SYNC_INTERVAL"), flag: "ssd-sync-interval", heading: SSD,
        help: "While running, flush the SSD tier this often when something was written since the last flush (footers, fdatasync of the segments, directory fsync; counted in segment_syncs and dir_syncs), so stored objects survive a power loss after at most about this long. 0: off, only a clean stop syncs (objects survive the process dying, not a power loss)" }
    CLUSTER_LISTEN { name: "cluster_listen", kind: "HOST:PORT", default: None, env: Some("UMBP_CLUSTER_LISTEN"), flag: "cluster-listen", heading: CLUSTER,
        help: "Join a cluster of pools: this pool's control address. Needs the NIXL library at run time (`pip install nixl-cu12`; set UMBP_NIXL_LIB to libnixl_capi.so or its directory) and --cluster-secret-file. With --namespace-acl every member must run the same ACL (a peer with another is refused); peers' objects are then listed only for the uids allowed their namespace [default: no cluster]" }
    CLUSTER_PEER { name: "cluster_peer", kind: "HOST:PORT", default: None, env: None, flag: "cluster-peer", heading: CLUSTER,
        help: "Another pool's --cluster-listen address (repeatable): its DRAM objects appear in this pool's index (that of their namespace's tenant group) marked remote and load over NIXL" }
    CLUSTER_SECRET_FILE { name: "cluster_secret_file", kind: "PATH", default: None, env: Some("UMBP_CLUSTER_SECRET_FILE"), flag: "cluster-secret-file", heading: CLUSTER,
        help: "File holding the shared cluster secret (at least 16 bytes, mode 0600); pools authenticate each other and encrypt their control connections with a key derived from it (Noise NNpsk0; the secret is never sent)" }
    CLUSTER_HEARTBEAT_MS { name: "cluster_heartbeat_ms", kind: "MS", default: Some("500"), env: None, flag: "cluster-heartbeat-ms", heading: CLUSTER,
        help: "Heartbeat period to peers" }
    CLUSTER_DEAD_AFTER_MS { name: "cluster_dead_after_ms", kind: "MS", default: Some("2000"), env: None, flag: "cluster-dead-after-ms", heading: CLUSTER,
        help: "A peer silent this long is dropped: its keys leave the index" }
    CLUSTER_READ_TIMEOUT_MS { name: "cluster_read_timeout_ms", kind: "MS", default: Some("5000"), env: None, flag: "cluster-read-timeout-ms", heading: CLUSTER,
        help: "Bound on one remote load (pin at the holder and NIXL READ); past it the block fails" }
    CLUSTER_MAX_REMOTE_ENTRIES { name: "cluster_max_remote_entries", kind: "N", default: None, env: None, flag: "cluster-max-remote-entries", heading: CLUSTER,
        help: "Most peers' keys listed in this pool's index at once (remote entries never crowd local objects out past it; further remote keys wait and are listed as room frees) [default: half of the index capacity]" }
    CLUSTER_PIN_LEASE_MARGIN_MS { name: "cluster_pin_lease_margin_ms", kind: "MS", default: Some("1000"), env: Some("UMBP_CLUSTER_PIN_LEASE_MARGIN_MS"), flag: "cluster-pin-lease-margin-ms", heading: CLUSTER,
        help: "A closed subscriber's pins are kept this long past --cluster-read-timeout-ms after its connection closes (a lease: its one-sided READs may still be in flight). Members run the same --cluster-read-timeout-ms" }
    CLUSTER_MAX_PINS_PER_PEER { name: "cluster_max_pins_per_peer", kind: "N", default: Some("4096"), env: Some("UMBP_CLUSTER_MAX_PINS_PER_PEER"), flag: "cluster-max-pins-per-peer", heading: CLUSTER,
        help: "Objects one subscribing peer may hold pinned here at once; a pin past it is refused" }
    CLUSTER_MAX_PINNED_BYTES_PER_PEER { name: "cluster_max_pinned_bytes_per_peer", kind: "SIZE", default: Some("4GiB"), env: Some("UMBP_CLUSTER_MAX_PINNED_BYTES_PER_PEER"), flag: "cluster-max-pinned-bytes-per-peer", heading: CLUSTER,
        help: "Bytes one subscribing peer may hold pinned here at once (sizes as --capacity)" }
    CLUSTER_EXPORT_BYTES { name: "cluster_export_bytes", kind: "SIZE", default: Some("256MiB"), env: Some("UMBP_CLUSTER_EXPORT_BYTES"), flag: "cluster-export-bytes", heading: CLUSTER,
        help: "Size of the export area (sizes as --capacity; rounded up to whole pages): the only memory peers can reach over NIXL. A peer's pin copies the object here and the peer reads the copy; a pin that finds no room is refused (counted, `export_full`) and the peer recomputes. Size it for the pins in flight: docs/operations.md" }
    CLUSTER_MAX_CATALOG_ENTRIES_PER_GROUP { name: "cluster_max_catalog_entries_per_group", kind: "N", default: Some("1048576"), env: Some("UMBP_CLUSTER_MAX_CATALOG_ENTRIES_PER_GROUP"), flag: "cluster-max-catalog-entries-per-group", heading: CLUSTER,
        help: "Keys one peer may have in this pool's catalog per tenant group; further keys are dropped (counted, `catalog_over_cap`)" }
    CLUSTER_MAX_UNAUTHENTICATED { name: "cluster_max_unauthenticated", kind: "N", default: Some("64"), env: Some("UMBP_CLUSTER_MAX_UNAUTHENTICATED"), flag: "cluster-max-unauthenticated", heading: CLUSTER,
        help: "Unauthenticated connections (handshake not done) held at once on the cluster port; past it a new one is closed at once (counted, `refused_connections`)" }
    CLUSTER_MAX_UNAUTHENTICATED_PER_SOURCE { name: "cluster_max_unauthenticated_per_source", kind: "N", default: Some("16"), env: Some("UMBP_CLUSTER_MAX_UNAUTHENTICATED_PER_SOURCE"), flag: "cluster-max-unauthenticated-per-source", heading: CLUSTER,
        help: "As --cluster-max-unauthenticated, per source address" }
    CLUSTER_ETCD { name: "cluster_etcd", kind: "URL[,URL]", default: None, env: Some("UMBP_CLUSTER_ETCD"), flag: "cluster-etcd", heading: CLUSTER,
        help: "Membership on etcd (http://HOST:PORT of each etcd member, comma-separated): this pool registers its --cluster-listen address under --cluster-etcd-prefix with a lease and dials every other member found there, beside any --cluster-peer. etcd only says whom to dial: the cluster secret still decides who is a member. etcd unreachable: the current members are kept (logged) and the pool registers again when it answers [default: off, the --cluster-peer list only]" }
    CLUSTER_ETCD_PREFIX { name: "cluster_etcd_prefix", kind: "PREFIX", default: None, env: Some("UMBP_CLUSTER_ETCD_PREFIX"), flag: "cluster-etcd-prefix", heading: CLUSTER,
        help: "etcd key prefix of this cluster: members are PREFIX/members/HOST:PORT; pools of one cluster use the same prefix [default: /umbp/default]" }
    CLUSTER_ETCD_TTL_S { name: "cluster_etcd_ttl_s", kind: "SECONDS", default: Some("10"), env: Some("UMBP_CLUSTER_ETCD_TTL_S"), flag: "cluster-etcd-ttl-s", heading: CLUSTER,
        help: "Lease of this pool's etcd registration (kept alive every third of it): a pool that stops (hung, killed, partitioned from etcd) leaves the others' view about this long after; a clean stop leaves at once" }
}

/// The row whose flag is `flag` (without dashes).
pub fn by_flag(flag: &str) -> Option<&'static Setting> {
    ALL.iter().copied().find(|s| s.flag == flag)
}

/// The row whose keyword argument is `name`.
pub fn by_name(name: &str) -> Option<&'static Setting> {
    ALL.iter().copied().find(|s| s.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Names, flags and variables are unique, so each face finds exactly one row.
    #[test]
    fn every_name_flag_and_variable_is_one_row() {
        let mut seen = std::collections::HashSet::new();
        for s in ALL {
            assert!(seen.insert(("name", s.name)), "name {} twice", s.name);
            assert!(seen.insert(("flag", s.flag)), "flag {} twice", s.flag);
            if let Some(env) = s.env {
                assert!(seen.insert(("env", env)), "variable {env} twice");
                assert!(env.starts_with("UMBP_"), "{env}");
            }
            assert!(!s.help.is_empty() && !s.help.ends_with('.'), "{}: help is one clap line without a full stop", s.flag);
            assert!(!s.flag.starts_with('-') && !s.name.contains('-'), "{}", s.flag);
        }
    }
}
