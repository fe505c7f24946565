//! The pool state report's types: what a `StatsRequest` answers with (JSON), what
//! `ringtool dump --json` prints, and what tests, benchmarks and the metrics endpoint read.
//! The pool builds them (`report.rs`); consumers deserialize the JSON back into them, so a
//! renamed or missing field is a compile error or a parse error naming the field, not a
//! silent `null`. The JSON form is described in docs/operations.md ("ringtool").
//!
//! The full report ([`PoolReport`]) goes to peers of the pool's own uid and root; any other
//! peer gets a [`TenantReport`] (docs/security.md). [`Report`] parses either.

use serde::{Deserialize, Serialize};

/// Either report, as a `StatsRequest` answers: the tenant one carries `"scope": "tenant"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Report {
    Tenant(TenantReport),
    Full(Box<PoolReport>),
}

impl Report {
    /// The full report, or an error that says this peer got the tenant view.
    pub fn into_full(self) -> Result<PoolReport, TenantReport> {
        match self {
            Report::Full(r) => Ok(*r),
            Report::Tenant(t) => Err(t),
        }
    }
}

/// The full report: for the pool's uid and root (operators, ringtool, tests).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolReport {
    /// Crate version of the pool.
    pub version: String,
    pub protocol_version: u32,
    pub pid: u32,
    pub socket: String,
    pub uptime_s: f64,
    /// Open file descriptors of the pool process (None: /proc unreadable).
    pub open_fds: Option<usize>,
    pub pool: PoolSection,
    pub namespaces: Vec<NamespaceReport>,
    /// Summed over the tenant groups' indexes (one group without `--namespace-acl`);
    /// None when no index mapping can be read (never in a healthy pool).
    pub index: Option<IndexReport>,
    /// Each tenant group's uids, namespaces, index and event log.
    pub groups: Vec<GroupReport>,
    pub attachments: Vec<AttachmentReport>,
    pub events: EventsReport,
    pub counters: CountersReport,
    /// Counters of each GPU copy engine (one per device and GPU backend) this process
    /// opened; empty without GPU registrations.
    #[serde(default)]
    pub gpu_engines: Vec<GpuEngineReport>,
    /// The SSD tier (docs/ssd.md); None: the pool has no SSD directory.
    #[serde(default)]
    pub ssd: Option<SsdReport>,
    /// Published objects by tier, all groups (what the indexes list).
    #[serde(default)]
    pub tiers: TierCounts,
    /// The cluster tier's counters (docs/cluster.md); None: the pool is in no cluster.
    #[serde(default)]
    pub cluster: Option<ClusterReport>,
}

/// The cluster tier's counters since start (docs/cluster.md, "Counters").
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ClusterReport {
    /// Peers connected and joined (this pool reads from them).
    pub peers: u64,
    /// Pools subscribed to this one (they read from it).
    pub subscribers: u64,
    /// Peers' keys in the catalog.
    pub remote_keys: u64,
    pub fetches: u64,
    pub fetch_failures: u64,
    pub fetched_bytes: u64,
    /// Handshakes that failed authentication (another secret).
    pub auth_failures: u64,
    /// Connections closed at accept: over the unauthenticated caps or the fd reserve.
    pub refused_connections: u64,
    /// Peers' pins refused at the per-subscriber caps.
    pub pins_over_cap: u64,
    /// Remote reads whose bytes did not match the holder's digest (misses, not published).
    pub digest_mismatches: u64,
    /// Remote reads that completed past the holder's pin lease (misses, not published).
    pub late_reads: u64,
    /// Pins this pool keeps for a subscriber whose connection closed, until their lease ends.
    pub leased_pins: u64,
    /// Pins of closed connections released at once: all leases held a subscriber's caps.
    #[serde(default)]
    pub leases_over_cap: u64,
    /// Peers' keys left out of the catalog at the per-group cap.
    pub catalog_over_cap: u64,
    /// Peers' keys not listed in the index at `--cluster-max-remote-entries`.
    pub remote_refused: u64,
    /// DRAM key changes sent to subscribers (each counted once per subscriber).
    pub published_changes: u64,
    /// Bytes of the export area holding copies for peers' pins now (leases included).
    #[serde(default)]
    pub export_bytes_used: u64,
    /// Peers' pins refused because the export area had no room for the copy.
    #[serde(default)]
    pub export_full: u64,
    /// Membership on etcd (`--cluster-etcd`, issue #35); None: the peers come from the
    /// `--cluster-peer` list only.
    #[serde(default)]
    pub etcd: Option<EtcdReport>,
}

/// etcd membership as an operator needs it: is etcd answering, is this pool findable.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct EtcdReport {
    /// The last poll of etcd succeeded.
    pub reachable: bool,
    /// Seconds since the last successful poll (since the membership started while none
    /// has): grows while etcd is down.
    pub seconds_since_success: f64,
    /// Requests to etcd that failed (no endpoint answered in time, or an error status).
    pub failed_requests: u64,
    /// Times etcd went from reachable to unreachable.
    pub outages: u64,
    /// Times this pool's key was written under a new lease (the first registration, and
    /// again after the lease expired).
    pub registrations: u64,
    /// Members under the prefix in the last successful read, this pool included (the view
    /// kept while etcd is down).
    pub members: u64,
    /// This pool's key was in that read and etcd confirmed its lease less than a TTL ago.
    pub registered: bool,
}

/// Objects the indexes list, by tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierCounts {
    /// Published in DRAM (loads copy from there).
    pub dram: u64,
    /// On SSD only (a load promotes them to DRAM first).
    pub ssd: u64,
    /// Held by another node (issue #17).
    #[serde(default)]
    pub remote: u64,
}

/// The SSD tier: what it holds, what moved, what failed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SsdReport {
    /// The directories (one shard per drive), in shard order.
    pub dirs: Vec<String>,
    /// Objects the tier holds (live records).
    pub objects: u64,
    /// Bytes of segment files in use (records, footers, dead records not yet reclaimed).
    pub bytes: u64,
    /// Bytes of live records.
    pub live_bytes: u64,
    /// Segment files (the store keeps each open).
    #[serde(default)]
    pub segments: u64,
    pub capacity_bytes: u64,
    pub high_watermark: f64,
    pub low_watermark: f64,
    /// The admission policy (`all`, `hit`, `never`, `hit-or-young:SECONDS`).
    pub admission: String,
    pub direct_io: bool,
    pub io_uring: bool,
    /// What moved between DRAM and SSD (the object store's counters), flat in the JSON;
    /// `report.demotions` reads through to them ([`std::ops::Deref`]).
    #[serde(flatten)]
    pub moves: TierMoves,
    /// Reads whose CRC32C did not match (served as misses).
    pub crc_misses: u64,
    pub read_errors: u64,
    pub write_errors: u64,
    /// Objects the tier dropped for room (oldest segments first).
    pub evicted_objects: u64,
    pub compactions: u64,
    /// Objects listed in the indexes at start from the segments (warm restart).
    pub restored_objects: u64,
    pub torn_records_skipped: u64,
    /// Segment files refused at start and left untouched: a symlink, not a regular file,
    /// another uid's, or hard-linked (docs/security.md, "The SSD directory").
    #[serde(default)]
    pub segments_refused: u64,
    pub rebuild_ms: f64,
    /// Records the store wrote (demotions, the clean stop's writes, records compaction moved).
    #[serde(default)]
    pub puts: u64,
    #[serde(default)]
    pub put_bytes: u64,
    /// Store reads that found a readable record (promotions, prefetches).
    #[serde(default)]
    pub hits: u64,
    /// Store reads that found none (absent, size mismatch, I/O error, bad CRC).
    #[serde(default)]
    pub misses: u64,
    /// Bytes of live records compaction moved.
    #[serde(default)]
    pub compacted_bytes: u64,
    /// Segment files fdatasynced by flushes (`--ssd-sync-interval`, the clean stop): every
    /// one written since its last sync (issue #34). Zero while nothing flushed: records
    /// written since survive the process dying, not a power loss (docs/ssd.md).
    #[serde(default)]
    pub segment_syncs: u64,
    /// Directory fsyncs by flushes (one per directory per flush).
    #[serde(default)]
    pub dir_syncs: u64,
    /// At start: segments read from their footer, segments whose records were scanned,
    /// segments skipped as unreadable (their objects are misses), records found in a
    /// directory their key does not map to (the directory list changed).
    #[serde(default)]
    pub segments_from_footer: u64,
    #[serde(default)]
    pub segments_scanned: u64,
    #[serde(default)]
    pub segments_unreadable: u64,
    #[serde(default)]
    pub misplaced_records: u64,
}

/// Objects moved between DRAM and SSD and the moves that failed: counted by the object
/// store (`objects::TierStats`), shown in [`SsdReport`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierMoves {
    /// Objects written to SSD when evicted from DRAM.
    pub demotions: u64,
    pub demoted_bytes: u64,
    /// Evicted objects the admission policy did not admit (dropped).
    pub not_admitted: u64,
    /// Demotions that failed (disk full, I/O error, no room): those objects were dropped.
    pub demotion_failures: u64,
    /// Objects brought back into DRAM by loads.
    pub promotions: u64,
    pub promoted_bytes: u64,
    /// Promotions that found no readable record (I/O error, bad CRC, dropped meanwhile): misses.
    pub promotion_failures: u64,
}

impl SsdReport {
    /// A report with a distinct value in every field, for the tests of its readers (the
    /// metrics endpoint, ringtool): one fixture, so a new field is added once.
    #[doc(hidden)]
    pub fn example() -> Self {
        SsdReport {
            dirs: vec!["/mnt/nvme0/umbp".into(), "/mnt/nvme1/umbp".into()],
            objects: 30,
            bytes: 3 << 30,
            live_bytes: 2 << 30,
            segments: 13,
            capacity_bytes: 4 << 30,
            high_watermark: 0.95,
            low_watermark: 0.85,
            admission: "hit-or-young:60".into(),
            direct_io: false,
            io_uring: true,
            moves: TierMoves {
                demotions: 77,
                demoted_bytes: 77 << 20,
                not_admitted: 5,
                demotion_failures: 2,
                promotions: 9,
                promoted_bytes: 9 << 20,
                promotion_failures: 1,
            },
            crc_misses: 3,
            read_errors: 4,
            write_errors: 6,
            evicted_objects: 8,
            compactions: 10,
            restored_objects: 1000,
            torn_records_skipped: 11,
            segments_refused: 13,
            rebuild_ms: 12.5,
            puts: 14,
            put_bytes: 14 << 20,
            hits: 15,
            misses: 16,
            compacted_bytes: 17 << 20,
            segment_syncs: 18,
            dir_syncs: 19,
            segments_from_footer: 20,
            segments_scanned: 21,
            segments_unreadable: 22,
            misplaced_records: 23,
        }
    }
}

impl std::ops::Deref for SsdReport {
    type Target = TierMoves;

    fn deref(&self) -> &TierMoves {
        &self.moves
    }
}

/// One GPU copy engine's counters: its backend's memory kind (`Cuda`, `Hip`) and the
/// engine's [`umbp_gpu::EngineStats`] as they are, flat in the JSON (`ordinal`,
/// `device_uuid` as hex, `calls`, `items`, `bytes`, `enqueue_ns`, `total_ns`, `stages`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuEngineReport {
    pub kind: String,
    #[serde(flatten)]
    pub engine: umbp_gpu::EngineStats,
}

impl PoolReport {
    /// Attachments of `role`.
    pub fn attachments_of(&self, role: PeerRole) -> impl Iterator<Item = &AttachmentReport> {
        self.attachments.iter().filter(move |a| a.role == role)
    }

    /// The attachment with pool-assigned `id`.
    pub fn attachment(&self, id: u32) -> Option<&AttachmentReport> {
        self.attachments.iter().find(|a| a.id == id)
    }
}

/// Size, use and policy of the DRAM tier.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolSection {
    pub capacity_bytes: u64,
    pub allocated_bytes: u64,
    /// Objects held (published or being written).
    pub objects: u64,
    pub published_objects: u64,
    /// Objects pinned by loads in flight.
    pub pinned_objects: u64,
    pub evictions: u64,
    /// DRAM a transfer may still write (a remote read that timed out, a copy thread that
    /// panicked inside the device layer), never handed out meanwhile
    /// (pool/src/store/objects/quarantine.rs).
    pub quarantined_bytes: u64,
    /// Quarantined ranges now.
    #[serde(default)]
    pub quarantined_ranges: u64,
    /// Quarantined DRAM handed back since the start (its writer can no longer land).
    #[serde(default)]
    pub quarantine_reclaimed_bytes: u64,
    /// The bound on quarantined DRAM (`quarantine_max_bytes`).
    #[serde(default)]
    pub quarantine_max_bytes: u64,
    /// Remote-tier promotions refused (a miss) because the quarantine was at its bound.
    #[serde(default)]
    pub quarantine_refusals: u64,
    /// DRAM held now by promotions launched ahead of their load's current stage
    /// (pool/src/copy/promote.rs; at most `promotion_ahead_bytes`).
    #[serde(default)]
    pub promotion_ahead_bytes: u64,
    /// Objects promoted ahead of their load's current stage since the start.
    #[serde(default)]
    pub promotions_ahead: u64,
    /// Index entries the pool admits (slots less the load-factor headroom).
    pub index_capacity: u64,
    pub defences: Defences,
    pub namespace_share: f64,
    pub lease_share: f64,
    pub events_written: u64,
    pub high_watermark: f64,
    pub low_watermark: f64,
    /// `--idle-poll-us`: `auto` or µs.
    #[serde(default)]
    pub idle_poll: String,
    /// How long idle threads poll now (µs): `--idle-poll-us` when fixed, adapted for `auto`.
    #[serde(default)]
    pub idle_poll_window_us: f64,
    /// DRAM registered with the GPU drivers so far (from the start of the tier; the
    /// allocator hands out only this part until registration is done).
    #[serde(default)]
    pub dram_registered_bytes: u64,
    /// Background DRAM registration finished (or there was none: host backends only).
    #[serde(default)]
    pub dram_registration_done: bool,
}

/// What the tenant defences did (docs/security.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Defences {
    pub index_evictions: u64,
    pub quota_evictions: u64,
    pub quota_refusals: u64,
    pub foreign_hints_ignored: u64,
    pub leases_dropped: u64,
}

/// Use of one namespace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamespaceReport {
    /// 32 hex digits.
    pub namespace: String,
    pub objects: u64,
    pub bytes: u64,
}

impl NamespaceReport {
    /// The namespace as a number (None: not 32 hex digits).
    pub fn id(&self) -> Option<u128> {
        u128::from_str_radix(&self.namespace, 16).ok()
    }
}

/// The shared index, read from its header (the index's own snapshot, flat in the JSON:
/// `slots`, `epoch`, `live`, ...; `report.live` reads through to it) and tables.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexReport {
    #[serde(flatten)]
    pub header: umbp_protocol::index::IndexSnapshot,
    /// Live entries by probe distance 0..7 (the last bucket is 7 and more).
    pub probe_histogram: Vec<u64>,
}

impl std::ops::Deref for IndexReport {
    type Target = umbp_protocol::index::IndexSnapshot;

    fn deref(&self) -> &Self::Target {
        &self.header
    }
}

/// One tenant group (docs/security.md): the peers of `uids` see only its index and
/// event log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupReport {
    pub group: u32,
    pub uids: Vec<u32>,
    /// 32 hex digits each.
    pub namespaces: Vec<String>,
    pub index: Option<IndexReport>,
    pub events: GroupEvents,
}

/// One tenant group's event log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupEvents {
    pub written: u64,
    pub region_bytes: u64,
}

/// The role a peer attached with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PeerRole {
    Worker,
    Scheduler,
    Observer,
}

impl From<umbp_protocol::wire::Role> for PeerRole {
    fn from(r: umbp_protocol::wire::Role) -> Self {
        use umbp_protocol::wire::Role;
        match r {
            Role::Worker => PeerRole::Worker,
            Role::Scheduler => PeerRole::Scheduler,
            Role::Observer => PeerRole::Observer,
        }
    }
}

/// Head, tail and flags of one shared ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RingReport {
    pub capacity: u32,
    pub head: u32,
    pub tail: u32,
    /// Entries between head and tail.
    pub pending: u32,
    pub need_wakeup: bool,
}

impl From<umbp_protocol::ring::RingSnapshot> for RingReport {
    fn from(s: umbp_protocol::ring::RingSnapshot) -> Self {
        Self { capacity: s.capacity, head: s.head, tail: s.tail, pending: s.len(), need_wakeup: s.need_wakeup }
    }
}

/// One registered memory region of an attachment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionReport {
    pub alloc_id: u32,
    /// Backend memory kind (`Host`, `Cuda`, ...).
    pub kind: String,
    pub bytes: u64,
    /// 32 hex digits of the GPU's UUID; None for host memory.
    pub device_uuid: Option<String>,
}

/// One attachment (a peer's handshake), its rings and traffic.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttachmentReport {
    pub id: u32,
    pub pid: u32,
    pub uid: u32,
    pub role: PeerRole,
    /// 32 hex digits.
    pub namespace: String,
    pub tp_rank: u32,
    pub tp_size: u32,
    pub dp_rank: u32,
    pub sq: RingReport,
    pub cq: RingReport,
    pub hints: RingReport,
    /// Completions waiting for room in the CQ.
    pub cq_overflow: usize,
    pub sq_paused: bool,
    pub sq_pauses: u64,
    pub inflight: u32,
    pub submissions: u64,
    pub errors: u64,
    pub blocks: u64,
    pub registered_bytes: u64,
    /// Number of registered regions.
    pub regions: usize,
    /// The registered regions, by alloc id.
    pub devices: Vec<RegionReport>,
    /// Layout groups registered.
    pub layouts: Vec<u16>,
}

/// The shared KV event log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventsReport {
    /// Entries of each group's event log.
    pub capacity: u32,
    pub written: u64,
    /// Bytes of all groups' event logs.
    pub region_bytes: u64,
}

/// Pool-wide traffic counters since start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CountersReport {
    pub submissions: u64,
    pub rejected_submissions: u64,
    pub transfers_cancelled: u64,
    pub blocks_stored: u64,
    pub blocks_already_present: u64,
    pub blocks_not_stored: u64,
    pub blocks_loaded: u64,
    pub blocks_missing: u64,
    pub blocks_failed: u64,
    pub blocks_invalid: u64,
    pub bytes_stored: u64,
    pub bytes_loaded: u64,
    pub hints: u64,
    pub attachments_total: u64,
    pub refusals: u64,
    pub busy_refusals: u64,
    /// Peers whose pidfd was taken with `pidfd_open` at accept (no `SO_PEERPIDFD`).
    pub pidfd_open_peers: u64,
    /// Times a worker's doorbell woke the sleeping service thread: transfers that found
    /// the pool asleep (the rest were caught while it polled).
    #[serde(default)]
    pub service_wakeups: u64,
    pub store_copy_ns: u64,
    pub load_copy_ns: u64,
    pub phases: Phases,
}

/// Where the time of stores and of loads goes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Phases {
    pub store: PhaseReport,
    pub load: PhaseReport,
}

/// Time of the jobs of one direction by phase, nanoseconds summed over jobs (the phases
/// are described at `PhaseCounters` in stats.rs and in docs/operations.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhaseReport {
    pub jobs: u64,
    pub stages: u64,
    pub admit_ns: u64,
    pub queue_ns: u64,
    pub reserve_ns: u64,
    pub plan_ns: u64,
    pub copy_ns: u64,
    pub publish_ns: u64,
    pub finish_ns: u64,
    /// From a copy thread taking the job to stage 0 handed to the device: what of
    /// `reserve_ns` and `plan_ns` delays the first byte (a report of an older pool has none).
    #[serde(default)]
    pub first_stage_ns: u64,
}

impl PhaseReport {
    /// `(phase, nanoseconds)` in the order a job goes through them.
    pub fn phases(&self) -> [(&'static str, u64); 7] {
        [
            ("admit", self.admit_ns),
            ("queue", self.queue_ns),
            ("reserve", self.reserve_ns),
            ("plan", self.plan_ns),
            ("copy", self.copy_ns),
            ("publish", self.publish_ns),
            ("finish", self.finish_ns),
        ]
    }
}

/// What a peer of another uid may know: its own attachments, the usage of the namespaces
/// they are attached with, and the pool's size and watermarks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TenantReport {
    pub scope: TenantScope,
    pub uid: u32,
    pub version: String,
    pub protocol_version: u32,
    pub pool: TenantPool,
    pub namespaces: Vec<NamespaceReport>,
    pub attachments: Vec<AttachmentReport>,
}

/// The `"scope": "tenant"` marker of a [`TenantReport`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TenantScope {
    Tenant,
}

/// The pool's size and watermarks, all a tenant sees of it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TenantPool {
    pub capacity_bytes: u64,
    pub high_watermark: f64,
    pub low_watermark: f64,
}

/// `Display` as compact JSON, the wire form (for logs and assertion messages).
macro_rules! display_as_json {
    ($($t:ty),*) => {$(
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&serde_json::to_string(self).map_err(|_| std::fmt::Error)?)
            }
        }
    )*};
}
display_as_json!(
    Report, PoolReport, PoolSection, Defences, NamespaceReport, IndexReport, GroupReport, AttachmentReport, CountersReport, Phases,
    SsdReport, TenantReport, ClusterReport
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_and_full_reports_parse_as_their_kind() {
        let t = serde_json::json!({
            "scope": "tenant", "uid": 7, "version": "0.1.0", "protocol_version": 1,
            "pool": {"capacity_bytes": 1, "high_watermark": 0.9, "low_watermark": 0.7},
            "namespaces": [], "attachments": [],
        });
        let r: Report = serde_json::from_value(t).unwrap();
        assert!(matches!(r, Report::Tenant(_)));
        // A full report missing a field is refused with the field's name.
        let e = serde_json::from_str::<PoolReport>(r#"{"version":"x"}"#).unwrap_err().to_string();
        assert!(e.contains("protocol_version"), "{e}");
    }

    /// The keys of `v` (a JSON object), sorted.
    fn keys(v: &serde_json::Value) -> Vec<&str> {
        let mut k: Vec<&str> = v.as_object().expect("an object").keys().map(|k| k.as_str()).collect();
        k.sort_unstable();
        k
    }

    /// Reports built from other types (`#[serde(flatten)]`) keep their flat JSON names
    /// (ringtool, metrics, Python and benches read them) and parse back to themselves.
    #[test]
    fn flattened_sections_keep_their_json_names() {
        let ssd = SsdReport::example();
        let v = serde_json::to_value(&ssd).unwrap();
        let mut want = vec![
            "dirs", "objects", "bytes", "live_bytes", "segments", "capacity_bytes", "high_watermark", "low_watermark", "admission",
            "direct_io", "io_uring", "demotions", "demoted_bytes", "not_admitted", "demotion_failures", "promotions", "promoted_bytes",
            "promotion_failures", "crc_misses", "read_errors", "write_errors", "evicted_objects", "compactions", "restored_objects",
            "torn_records_skipped", "segments_refused", "rebuild_ms", "puts", "put_bytes", "hits", "misses", "compacted_bytes",
            "segment_syncs", "dir_syncs", "segments_from_footer", "segments_scanned", "segments_unreadable", "misplaced_records",
        ];
        want.sort_unstable();
        assert_eq!(keys(&v), want);
        assert_eq!(v["demotions"], 77);
        assert_eq!(serde_json::from_value::<SsdReport>(v).unwrap(), ssd);

        let mut uuid = [0u8; 16];
        uuid[0] = 0xab;
        uuid[15] = 0x01;
        let gpu = GpuEngineReport {
            kind: "Cuda".into(),
            engine: umbp_gpu::EngineStats {
                ordinal: 1,
                device_uuid: uuid,
                calls: 2,
                items: 3,
                bytes: 4,
                enqueue_ns: 5,
                total_ns: 6,
                stages: 7,
            },
        };
        let v = serde_json::to_value(&gpu).unwrap();
        let mut want = vec!["kind", "ordinal", "device_uuid", "calls", "items", "bytes", "enqueue_ns", "total_ns", "stages"];
        want.sort_unstable();
        assert_eq!(keys(&v), want);
        assert_eq!(v["device_uuid"], "ab000000000000000000000000000001");
        assert_eq!(serde_json::from_value::<GpuEngineReport>(v).unwrap(), gpu);
        let bad = serde_json::json!({"kind": "Cuda", "ordinal": 0, "device_uuid": "xyz", "calls": 0, "items": 0,
            "bytes": 0, "enqueue_ns": 0, "total_ns": 0, "stages": 0});
        let e = serde_json::from_value::<GpuEngineReport>(bad).unwrap_err().to_string();
        assert!(e.contains("device_uuid"), "{e}");

        let header =
            umbp_protocol::index::IndexSnapshot { slot_count: 1, epoch: 2, live: 3, tombstones: 4, inserts: 5, removes: 6, rebuilds: 7 };
        let ix = IndexReport { header, probe_histogram: vec![3, 0] };
        let v = serde_json::to_value(&ix).unwrap();
        assert_eq!(keys(&v), ["epoch", "inserts", "live", "probe_histogram", "rebuilds", "removes", "slots", "tombstones"]);
        assert_eq!(v["slots"], 1);
        assert_eq!(serde_json::from_value::<IndexReport>(v).unwrap(), ix);
    }
}
