//! The pool state report (JSON): what `ringtool dump` shows and tests assert against.
//! The full report goes to peers of the pool's own uid and root only (operators, ringtool);
//! any other peer gets [`tenant`]: its own uid's attachments and namespaces, nothing of
//! other tenants (docs/security.md).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::attachment::Attachment;
use crate::PoolInner;

fn ring_json(s: umbp_protocol::ring::RingSnapshot) -> serde_json::Value {
    serde_json::json!({
        "capacity": s.capacity, "head": s.head, "tail": s.tail,
        "pending": s.len(), "need_wakeup": s.need_wakeup,
    })
}

fn uuid_hex(u: &[u8; 16]) -> String {
    u.iter().map(|b| format!("{b:02x}")).collect()
}

/// Registered regions of one attachment: alloc id, memory kind, bytes, device UUID.
fn regions_json(a: &Attachment) -> Vec<serde_json::Value> {
    let devices = a.region_devices.lock().expect("devices lock").clone();
    let mut regions: Vec<_> = a
        .regions
        .read()
        .expect("regions lock")
        .iter()
        .map(|(id, r)| {
            let uuid = devices.get(id).copied().unwrap_or_default();
            serde_json::json!({
                "alloc_id": id,
                "kind": format!("{:?}", r.kind()),
                "bytes": r.len(),
                "device_uuid": if uuid == [0; 16] { serde_json::Value::Null } else { uuid_hex(&uuid).into() },
            })
        })
        .collect();
    regions.sort_by_key(|r| r["alloc_id"].as_u64());
    regions
}

fn open_fds() -> Option<usize> {
    std::fs::read_dir("/proc/self/fd").ok().map(|d| d.count())
}

/// The report a StatsRequest from `att` gets: the full one for the pool's uid and root,
/// the tenant one for everyone else.
pub fn for_peer(inner: &PoolInner, att: &Attachment) -> serde_json::Value {
    if att.uid == inner.uid || att.uid == 0 {
        build(inner)
    } else {
        tenant(inner, att.uid)
    }
}

/// What a peer of `uid` may know: its own attachments, the usage of the namespaces they
/// are attached with, and the pool's size and watermarks. No pids, uids or namespaces of
/// anyone else, no pool-wide counters.
pub fn tenant(inner: &PoolInner, uid: u32) -> serde_json::Value {
    let own: Vec<Arc<Attachment>> =
        inner.attachments.lock().expect("attachments lock").iter().filter(|a| a.uid == uid).cloned().collect();
    let mut mine: Vec<u128> = own.iter().map(|a| a.namespace).collect();
    mine.sort_unstable();
    mine.dedup();
    let (pool, namespaces) = {
        let store = inner.store.lock().expect("store lock");
        let namespaces: Vec<_> = mine
            .iter()
            .map(|ns| {
                let u = store.namespaces().get(ns).copied().unwrap_or_default();
                serde_json::json!({ "namespace": format!("{ns:032x}"), "objects": u.objects, "bytes": u.bytes })
            })
            .collect();
        let pool = serde_json::json!({
            "capacity_bytes": store.capacity_bytes(),
            "high_watermark": inner.config.high_watermark,
            "low_watermark": inner.config.low_watermark,
        });
        (pool, namespaces)
    };
    serde_json::json!({
        "scope": "tenant",
        "uid": uid,
        "version": env!("CARGO_PKG_VERSION"),
        "protocol_version": umbp_protocol::PROTOCOL_VERSION,
        "pool": pool,
        "namespaces": namespaces,
        "attachments": own.iter().map(|a| attachment_json(a)).collect::<Vec<_>>(),
    })
}

fn attachment_json(a: &Attachment) -> serde_json::Value {
    let (sq, cq, hints) = a.ring_snapshots();
    serde_json::json!({
        "id": a.id, "pid": a.pid, "uid": a.uid, "role": format!("{:?}", a.role).to_lowercase(),
        "namespace": format!("{:032x}", a.namespace),
        "tp_rank": a.tp_rank, "tp_size": a.tp_size, "dp_rank": a.dp_rank,
        "sq": ring_json(sq), "cq": ring_json(cq), "hints": ring_json(hints),
        "cq_overflow": a.overflow_len(),
        "sq_paused": a.sq_paused.load(Ordering::Relaxed),
        "sq_pauses": a.counters.sq_pauses.load(Ordering::Relaxed),
        "inflight": a.inflight.load(Ordering::Relaxed),
        "submissions": a.counters.submissions.load(Ordering::Relaxed),
        "errors": a.counters.errors.load(Ordering::Relaxed),
        "blocks": a.counters.blocks.load(Ordering::Relaxed),
        "registered_bytes": a.registered_bytes(),
        "regions": a.regions.read().expect("regions lock").len(),
        "devices": regions_json(a),
        "layouts": a.layouts.read().expect("layouts lock").keys().collect::<Vec<_>>(),
    })
}

pub fn build(inner: &PoolInner) -> serde_json::Value {
    let (pool, namespaces, group_events) = {
        let store = inner.store.lock().expect("store lock");
        let namespaces: Vec<_> = store
            .namespaces()
            .iter()
            .map(|(ns, u)| serde_json::json!({ "namespace": format!("{ns:032x}"), "objects": u.objects, "bytes": u.bytes }))
            .collect();
        let pool = serde_json::json!({
            "capacity_bytes": store.capacity_bytes(),
            "allocated_bytes": store.allocated_bytes(),
            "objects": store.object_count(),
            "published_objects": store.published_count(),
            "pinned_objects": store.pinned_count(),
            "evictions": store.evictions(),
            "quarantined_bytes": store.quarantined_bytes(),
            "index_capacity": store.index_capacity(),
            "defences": store.defence_counters(),
            "namespace_share": inner.config.namespace_share,
            "lease_share": inner.config.lease_share,
            "events_written": store.events_written(),
            "high_watermark": inner.config.high_watermark,
            "low_watermark": inner.config.low_watermark,
        });
        let group_events: Vec<u64> = (0..store.group_count() as u32).map(|g| store.group_events_written(g)).collect();
        (pool, namespaces, group_events)
    };
    // Summed over the tenant groups' indexes; each group's in `groups`.
    let (index, groups, events_region_bytes) = crate::group_report::build(inner, &group_events);
    // Snapshot the list first: no attachment's locks are taken under `attachments`.
    let list: Vec<Arc<Attachment>> = inner.attachments.lock().expect("attachments lock").clone();
    let attachments: Vec<_> = list.iter().map(|a| attachment_json(a)).collect();
    serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "protocol_version": umbp_protocol::PROTOCOL_VERSION,
        "pid": std::process::id(),
        "socket": inner.config.socket_path.display().to_string(),
        "uptime_s": inner.started.elapsed().as_secs_f64(),
        "open_fds": open_fds(),
        "pool": pool,
        "namespaces": namespaces,
        "index": index,
        "groups": groups,
        "attachments": attachments,
        "events": {
            "capacity": inner.config.event_log_entries,
            "written": pool["events_written"],
            "region_bytes": events_region_bytes,
        },
        "counters": inner.counters.to_json(),
    })
}
