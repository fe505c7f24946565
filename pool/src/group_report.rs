//! The tenant groups' part of the full state report (report.rs): each group's index and
//! event log, and the pool-wide `index` section summed over the groups (without
//! `--namespace-acl` there is one group and the sum is its index).

use umbp_protocol::index::IndexView;

use crate::PoolInner;

fn index_json(inner: &PoolInner, group: usize) -> Option<serde_json::Value> {
    let m = &inner.group_mem[group].index_mem;
    // SAFETY: the pool's own index mapping, alive as long as `inner`.
    let v = unsafe { IndexView::attach(m.as_ptr(), m.len()) }.ok()?;
    let s = v.snapshot();
    Some(serde_json::json!({
        "slots": s.slot_count, "epoch": s.epoch, "live": s.live, "tombstones": s.tombstones,
        "inserts": s.inserts, "removes": s.removes, "rebuilds": s.rebuilds,
        "probe_histogram": v.probe_histogram(8),
    }))
}

/// `(index, groups, event log bytes)`: the summed index section, one entry per group
/// (its uids, namespaces, index and event log), and the bytes of all event logs.
/// `events_written[g]` is group g's count (read under the store lock by the caller).
pub fn build(inner: &PoolInner, events_written: &[u64]) -> (Option<serde_json::Value>, serde_json::Value, u64) {
    let per: Vec<Option<serde_json::Value>> = (0..inner.group_mem.len()).map(|g| index_json(inner, g)).collect();
    let mut total: Option<serde_json::Value> = None;
    for ix in per.iter().flatten() {
        let Some(t) = total.as_mut() else {
            total = Some(ix.clone());
            continue;
        };
        for k in ["slots", "live", "tombstones", "inserts", "removes", "rebuilds"] {
            t[k] = (t[k].as_u64().unwrap_or(0) + ix[k].as_u64().unwrap_or(0)).into();
        }
        let sum: Vec<u64> = t["probe_histogram"]
            .as_array()
            .into_iter()
            .flatten()
            .zip(ix["probe_histogram"].as_array().into_iter().flatten())
            .map(|(a, b)| a.as_u64().unwrap_or(0) + b.as_u64().unwrap_or(0))
            .collect();
        t["probe_histogram"] = sum.into();
    }
    let groups: Vec<serde_json::Value> = inner
        .tenant_groups
        .specs()
        .iter()
        .enumerate()
        .map(|(g, spec)| {
            serde_json::json!({
                "group": g,
                "uids": spec.uids,
                "namespaces": spec.namespaces.iter().map(|ns| format!("{ns:032x}")).collect::<Vec<_>>(),
                "index": per[g],
                "events": {
                    "written": events_written.get(g).copied().unwrap_or(0),
                    "region_bytes": inner.group_mem[g].events_mem.len(),
                },
            })
        })
        .collect();
    let log_bytes = inner.group_mem.iter().map(|g| g.events_mem.len() as u64).sum();
    (total, groups.into(), log_bytes)
}
