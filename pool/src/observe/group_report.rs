//! The tenant groups' part of the full state report (report.rs): each group's index and
//! event log, and the pool-wide `index` section summed over the groups (without
//! `--namespace-acl` there is one group and the sum is its index).

use umbp_protocol::index::IndexView;

use crate::pool_report::{GroupEvents, GroupReport, IndexReport};
use crate::PoolInner;

/// Group `group`'s index header and (with `histogram`) its probe-length histogram, which
/// walks the table.
fn index(inner: &PoolInner, group: usize, histogram: bool) -> Option<IndexReport> {
    let m = &inner.store.group_mem[group].index_mem;
    // SAFETY: the pool's own index mapping, alive as long as `inner`.
    let v = unsafe { IndexView::attach(m.as_ptr(), m.len()) }.ok()?;
    let probe_histogram = if histogram { v.probe_histogram(8) } else { Vec::new() };
    Some(IndexReport { header: v.snapshot(), probe_histogram })
}

/// The indexes summed (epoch: group 0's); None when none can be read.
fn sum(per: &[Option<IndexReport>]) -> Option<IndexReport> {
    let mut total: Option<IndexReport> = None;
    for ix in per.iter().flatten() {
        let Some(t) = total.as_mut() else {
            total = Some(ix.clone());
            continue;
        };
        let (h, x) = (&mut t.header, &ix.header);
        h.slot_count += x.slot_count;
        h.live += x.live;
        h.tombstones += x.tombstones;
        h.inserts += x.inserts;
        h.removes += x.removes;
        h.rebuilds += x.rebuilds;
        for (a, b) in t.probe_histogram.iter_mut().zip(&ix.probe_histogram) {
            *a += b;
        }
    }
    total
}

/// The summed index header without the histogram, for the metrics endpoint (a scrape
/// never walks the tables).
pub fn index_totals(inner: &PoolInner) -> Option<IndexReport> {
    let per: Vec<_> = (0..inner.store.group_mem.len()).map(|g| index(inner, g, false)).collect();
    sum(&per)
}

/// `(index, groups, event log bytes)`: the summed index section, one entry per group
/// (its uids, namespaces, index and event log), and the bytes of all event logs.
/// `events_written[g]` is group g's count (read under the store lock by the caller).
pub fn build(inner: &PoolInner, events_written: &[u64]) -> (Option<IndexReport>, Vec<GroupReport>, u64) {
    let per: Vec<Option<IndexReport>> = (0..inner.store.group_mem.len()).map(|g| index(inner, g, true)).collect();
    let total = sum(&per);
    let groups = inner
        .store
        .tenant_groups
        .specs()
        .iter()
        .enumerate()
        .map(|(g, spec)| GroupReport {
            group: g as u32,
            uids: spec.uids.clone(),
            namespaces: spec.namespaces.iter().map(|ns| format!("{ns:032x}")).collect(),
            index: per[g].clone(),
            events: GroupEvents {
                written: events_written.get(g).copied().unwrap_or(0),
                region_bytes: inner.store.group_mem[g].events_mem.len() as u64,
            },
        })
        .collect();
    let log_bytes = inner.store.group_mem.iter().map(|g| g.events_mem.len() as u64).sum();
    (total, groups, log_bytes)
}
