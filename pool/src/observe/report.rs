//! Builds the pool state report ([`crate::pool_report`]): what `ringtool dump` shows and
//! tests assert against. The full report goes to peers of the pool's own uid and root only
//! (operators, ringtool); any other peer gets [`tenant`]: its own uid's attachments and
//! namespaces, nothing of other tenants (docs/security.md).

use crate::pool_report::{
    EventsReport, GpuEngineReport, NamespaceReport, PoolReport, PoolSection, Report, SsdReport, TenantPool, TenantReport, TenantScope,
    TierCounts,
};
use crate::store::objects::ObjectStore;
use crate::tier::TierSource;
use crate::PoolInner;

fn namespace(ns: u128, u: crate::store::objects::NamespaceUsage) -> NamespaceReport {
    NamespaceReport { namespace: format!("{ns:032x}"), objects: u.objects, bytes: u.bytes }
}

fn open_fds() -> Option<usize> {
    std::fs::read_dir("/proc/self/fd").ok().map(|d| d.count())
}

/// The report a StatsRequest from a peer of `uid` gets: the full one for the pool's uid
/// and root, the tenant one for everyone else.
pub fn for_peer(inner: &PoolInner, uid: u32) -> Report {
    if uid == inner.uid || uid == 0 {
        Report::Full(Box::new(build(inner)))
    } else {
        Report::Tenant(tenant(inner, uid))
    }
}

/// What a peer of `uid` may know: its own attachments, the usage of the namespaces they
/// are attached with, and the pool's size and watermarks. No pids, uids or namespaces of
/// anyone else, no pool-wide counters.
pub fn tenant(inner: &PoolInner, uid: u32) -> TenantReport {
    let own: Vec<_> = inner.attachments.lock().expect("attachments lock").iter().filter(|a| a.uid == uid).cloned().collect();
    let mut mine: Vec<u128> = own.iter().map(|a| a.namespace).collect();
    mine.sort_unstable();
    mine.dedup();
    let (pool, namespaces) = {
        let store = inner.store.objects.lock().expect("store lock");
        let namespaces: Vec<_> = mine.iter().map(|ns| namespace(*ns, store.namespaces().get(ns).copied().unwrap_or_default())).collect();
        let pool = TenantPool {
            capacity_bytes: store.capacity_bytes(),
            high_watermark: inner.config.high_watermark,
            low_watermark: inner.config.low_watermark,
        };
        (pool, namespaces)
    };
    TenantReport {
        scope: TenantScope::Tenant,
        uid,
        version: env!("CARGO_PKG_VERSION").to_string(),
        protocol_version: umbp_protocol::PROTOCOL_VERSION,
        pool,
        namespaces,
        attachments: own.iter().map(|a| a.report()).collect(),
    }
}

/// The pool section: size, use, policy. Also read by the metrics endpoint.
pub fn pool_section(inner: &PoolInner, store: &ObjectStore) -> PoolSection {
    let (dram_registered_bytes, dram_registration_done) = inner.store.dram.registration();
    let quarantine = store.quarantine_stats();
    PoolSection {
        capacity_bytes: store.capacity_bytes(),
        allocated_bytes: store.allocated_bytes(),
        objects: store.object_count() as u64,
        published_objects: store.published_count(),
        pinned_objects: store.pinned_count() as u64,
        evictions: store.evictions(),
        quarantined_bytes: quarantine.bytes,
        quarantined_ranges: quarantine.ranges,
        quarantine_reclaimed_bytes: quarantine.reclaimed_bytes,
        quarantine_max_bytes: quarantine.max_bytes,
        quarantine_refusals: quarantine.refusals,
        promotion_ahead_bytes: inner.promoter.ahead_bytes(),
        promotions_ahead: inner.promoter.launched_ahead(),
        index_capacity: store.index_capacity(),
        defences: store.defence_counters(),
        namespace_share: inner.config.namespace_share,
        lease_share: inner.config.lease_share,
        events_written: store.events_written(),
        high_watermark: inner.config.high_watermark,
        low_watermark: inner.config.low_watermark,
        idle_poll: inner.config.idle_poll.to_string(),
        idle_poll_window_us: inner.idle_poll().as_nanos() as f64 / 1e3,
        dram_registered_bytes,
        dram_registration_done,
    }
}

pub fn build(inner: &PoolInner) -> PoolReport {
    let (pool, namespaces, group_events, tier_stats) = {
        let store = inner.store.objects.lock().expect("store lock");
        let namespaces: Vec<_> = store.namespaces().iter().map(|(ns, u)| namespace(*ns, *u)).collect();
        let group_events: Vec<u64> = (0..store.group_count() as u32).map(|g| store.group_events_written(g)).collect();
        (pool_section(inner, &store), namespaces, group_events, store.tier_stats())
    };
    // The SSD store's own locks, never under the store lock.
    let ssd = inner.tiers.ssd.as_deref().map(|t| ssd_report(t, &tier_stats));
    // Summed over the tenant groups' indexes; each group's in `groups`.
    let (index, groups, events_region_bytes) = crate::observe::group_report::build(inner, &group_events);
    // Snapshot the list first: no attachment's locks are taken under `attachments`.
    let list: Vec<_> = inner.attachments.lock().expect("attachments lock").clone();
    PoolReport {
        version: env!("CARGO_PKG_VERSION").to_string(),
        protocol_version: umbp_protocol::PROTOCOL_VERSION,
        pid: std::process::id(),
        socket: inner.config.socket_path.display().to_string(),
        uptime_s: inner.started.elapsed().as_secs_f64(),
        open_fds: open_fds(),
        events: EventsReport { capacity: inner.config.event_log_entries, written: pool.events_written, region_bytes: events_region_bytes },
        pool,
        namespaces,
        index,
        groups,
        attachments: list.iter().map(|a| a.report()).collect(),
        counters: inner.counters.snapshot(),
        gpu_engines: gpu_engines(),
        ssd,
        tiers: TierCounts { dram: tier_stats.objects[0], ssd: tier_stats.objects[1], remote: tier_stats.objects[2] },
        cluster: inner.remote_source.cluster_report(),
    }
}

/// The SSD tier's section: the store's state and counters and the demoter's.
pub fn ssd_report(t: &crate::tier::SsdTier, ts: &crate::store::objects::TierStats) -> SsdReport {
    let st = t.store.stats();
    SsdReport {
        dirs: t.config.dirs.iter().map(|d| d.display().to_string()).collect(),
        objects: st.objects,
        bytes: st.used_bytes,
        live_bytes: st.live_bytes,
        segments: st.segments,
        capacity_bytes: st.capacity_bytes,
        high_watermark: t.config.high_watermark,
        low_watermark: t.config.low_watermark,
        admission: t.config.admission.to_string(),
        direct_io: st.direct_io,
        io_uring: st.io_uring,
        moves: ts.moves,
        crc_misses: st.crc_failures,
        read_errors: st.read_errors,
        write_errors: st.write_errors,
        evicted_objects: st.evicted_objects,
        compactions: st.compactions,
        restored_objects: ts.restored,
        torn_records_skipped: st.torn_records_skipped,
        segments_refused: st.segments_refused,
        rebuild_ms: st.rebuild_ms,
        puts: st.puts,
        put_bytes: st.put_bytes,
        hits: st.hits,
        misses: st.misses,
        compacted_bytes: st.compacted_bytes,
        segment_syncs: st.segment_syncs,
        dir_syncs: st.dir_syncs,
        segments_from_footer: st.segments_from_footer,
        segments_scanned: st.segments_scanned,
        segments_unreadable: st.segments_unreadable,
        misplaced_records: st.misplaced_records,
    }
}

/// Counters of each GPU copy engine (one per device and GPU backend) this process opened;
/// empty without GPU registrations.
fn gpu_engines() -> Vec<GpuEngineReport> {
    umbp_gpu::loaded_backends()
        .iter()
        .flat_map(|b| b.engine_stats().into_iter().map(move |e| (b.kind(), e)))
        .map(|(kind, engine)| GpuEngineReport { kind: format!("{kind:?}"), engine })
        .collect()
}
