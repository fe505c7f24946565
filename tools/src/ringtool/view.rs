//! Readable renderings of the pool report: `dump`'s tables and `watch`'s live screen.

use std::time::Duration;

use umbp_pool::pool_report::{
    AttachmentReport, ClusterReport, NamespaceReport, PeerRole, PoolReport, Report, RingReport, SsdReport, TenantReport,
};

pub fn bytes(n: f64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n;
    let mut i = 0;
    while v.abs() >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{v:.0} B")
    } else {
        format!("{v:.1} {}", UNITS[i])
    }
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".into(), |v| v.to_string())
}

/// A left-aligned table with a header row.
fn table(head: &[&str], rows: &[Vec<String>], indent: usize) -> String {
    let mut width: Vec<usize> = head.iter().map(|h| h.len()).collect();
    for r in rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let pad = " ".repeat(indent);
    let line = |cells: Vec<&str>| {
        let mut out = pad.clone();
        for (c, w) in cells.iter().zip(&width) {
            out.push_str(&format!("{c:<w$}  "));
        }
        out.trim_end().to_string() + "\n"
    };
    let mut out = line(head.to_vec());
    for r in rows {
        out.push_str(&line(r.iter().map(String::as_str).collect()));
    }
    out
}

fn ring_cell(r: &RingReport) -> String {
    format!("{}/{}", r.head, r.tail)
}

fn short_ns(t: &str) -> String {
    if t.len() > 12 {
        format!("{}..{}", &t[..4], &t[t.len() - 4..])
    } else {
        t.to_string()
    }
}

fn devices_cell(a: &AttachmentReport) -> String {
    if a.devices.is_empty() {
        return "-".into();
    }
    a.devices
        .iter()
        .map(|d| {
            let uuid = d.device_uuid.as_deref().map(|u| format!(" {}", &u[..8.min(u.len())])).unwrap_or_default();
            format!("#{} {}{} {}", d.alloc_id, d.kind, uuid, bytes(d.bytes as f64))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn namespaces_table(out: &mut String, namespaces: &[NamespaceReport]) {
    let ns: Vec<Vec<String>> = namespaces.iter().map(|n| vec![n.namespace.clone(), n.objects.to_string(), bytes(n.bytes as f64)]).collect();
    out.push_str(&format!("NAMESPACES ({})\n", ns.len()));
    if !ns.is_empty() {
        out.push_str(&table(&["namespace", "objects", "bytes"], &ns, 2));
    }
}

fn attachments_table(out: &mut String, attachments: &[AttachmentReport]) {
    let atts: Vec<Vec<String>> = attachments
        .iter()
        .map(|a| {
            vec![
                a.id.to_string(),
                a.pid.to_string(),
                role(a.role).to_string(),
                short_ns(&a.namespace),
                format!("{}/{}", a.tp_rank, a.tp_size),
                ring_cell(&a.sq),
                ring_cell(&a.cq),
                ring_cell(&a.hints),
                a.inflight.to_string(),
                format!("{}/{}", if a.sq.need_wakeup { "sq" } else { "-" }, if a.cq.need_wakeup { "cq" } else { "-" }),
                a.submissions.to_string(),
                a.blocks.to_string(),
                a.errors.to_string(),
                bytes(a.registered_bytes as f64),
                devices_cell(a),
            ]
        })
        .collect();
    out.push_str(&format!("\nATTACHMENTS ({})\n", atts.len()));
    if !atts.is_empty() {
        out.push_str(&table(
            &[
                "id", "pid", "role", "namespace", "tp", "sq h/t", "cq h/t", "hints h/t", "inflight", "wakeup", "subm", "blocks", "errors",
                "registered", "devices",
            ],
            &atts,
            2,
        ));
    }
}

fn role(r: PeerRole) -> &'static str {
    match r {
        PeerRole::Worker => "worker",
        PeerRole::Scheduler => "scheduler",
        PeerRole::Observer => "observer",
    }
}

/// `ringtool dump` without `--json`, for either report.
pub fn dump_any(r: &Report) -> String {
    match r {
        Report::Full(r) => dump(r),
        Report::Tenant(t) => dump_tenant(t),
    }
}

/// A tenant's view: the pool's size, its own namespaces and attachments.
pub fn dump_tenant(r: &TenantReport) -> String {
    let p = &r.pool;
    let mut out = format!(
        "umbp-pool {}  protocol {}  (tenant view for uid {}: the pool runs as another user)\n\nPOOL\n  capacity {}  watermarks low {} / high {}\n\n",
        r.version,
        r.protocol_version,
        r.uid,
        bytes(p.capacity_bytes as f64),
        p.low_watermark,
        p.high_watermark
    );
    namespaces_table(&mut out, &r.namespaces);
    attachments_table(&mut out, &r.attachments);
    out
}

/// `ringtool dump` without `--json`.
pub fn dump(r: &PoolReport) -> String {
    let p = &r.pool;
    let cap = p.capacity_bytes as f64;
    let alloc = p.allocated_bytes as f64;
    let mut out = format!(
        "umbp-pool {}  pid {}  protocol {}  socket {}\n  uptime {:.1} s  open fds {}\n\n",
        r.version,
        r.pid,
        r.protocol_version,
        r.socket,
        r.uptime_s,
        opt(r.open_fds)
    );
    out.push_str(&format!(
        "POOL\n  capacity {}  allocated {} ({:.1}%)  watermarks low {} / high {}\n  objects {}  published {}  pinned {}\n",
        bytes(cap),
        bytes(alloc),
        if cap > 0.0 { 100.0 * alloc / cap } else { 0.0 },
        p.low_watermark,
        p.high_watermark,
        p.objects,
        p.published_objects,
        p.pinned_objects
    ));
    if !p.dram_registration_done {
        out.push_str(&format!(
            "  GPU registration of DRAM in progress: {} of {} ({:.0}%); stores use the registered part\n",
            bytes(p.dram_registered_bytes as f64),
            bytes(cap),
            if cap > 0.0 { 100.0 * p.dram_registered_bytes as f64 / cap } else { 0.0 }
        ));
    }
    out.push_str(&format!("  evictions {}  KV events written {} (log of {} entries)\n", p.evictions, r.events.written, r.events.capacity));
    out.push_str(&format!(
        "  idle poll {} (window now {:.0} µs)  submissions that found the pool asleep {} of {}\n",
        if p.idle_poll.is_empty() { "?" } else { &p.idle_poll },
        p.idle_poll_window_us,
        r.counters.service_wakeups,
        r.counters.submissions
    ));
    let t = &r.tiers;
    out.push_str(&format!(
        "  objects by tier (indexes)  {}\n\n",
        crate::ringtool::tiers::summary_line([("dram", t.dram), ("ssd", t.ssd), ("remote", t.remote)])
    ));
    if let Some(ssd) = &r.ssd {
        ssd_section(&mut out, ssd);
    }
    if let Some(c) = &r.cluster {
        cluster_section(&mut out, c);
    }
    namespaces_table(&mut out, &r.namespaces);
    attachments_table(&mut out, &r.attachments);
    if let Some(ix) = &r.index {
        let slots = ix.slot_count as f64;
        out.push_str(&format!(
            "\nINDEX\n  slots {}  live {} ({:.1}% occupied)  tombstones {}  epoch {}  inserts {}  removes {}  rebuilds {}\n",
            ix.slot_count,
            ix.live,
            if slots > 0.0 { 100.0 * ix.live as f64 / slots } else { 0.0 },
            ix.tombstones,
            ix.epoch,
            ix.inserts,
            ix.removes,
            ix.rebuilds
        ));
        let hist: Vec<String> =
            ix.probe_histogram.iter().enumerate().map(|(i, n)| format!("{i}{}:{n}", if i == 7 { "+" } else { "" })).collect();
        out.push_str(&format!("  probe lengths  {}\n", hist.join("  ")));
    }
    // With --namespace-acl: one index and event log per tenant group (the INDEX above is
    // their sum).
    if r.groups.len() > 1 {
        out.push_str("\nTENANT GROUPS (own index and event log each)\n");
        for g in &r.groups {
            let list = |items: Vec<String>| if items.is_empty() { "-".to_string() } else { items.join(",") };
            let ix = g.index.as_ref();
            out.push_str(&format!(
                "  group {}  uids {}  namespaces {}\n    index slots {}  live {}  tombstones {}  inserts {}  removes {}  events written {}\n",
                g.group,
                if g.group == 0 { "(pool's, root)".to_string() } else { list(g.uids.iter().map(u32::to_string).collect()) },
                if g.group == 0 { "(not listed)".to_string() } else { list(g.namespaces.clone()) },
                opt(ix.map(|i| i.slot_count)),
                opt(ix.map(|i| i.live)),
                opt(ix.map(|i| i.tombstones)),
                opt(ix.map(|i| i.inserts)),
                opt(ix.map(|i| i.removes)),
                g.events.written,
            ));
        }
    }
    let c = &r.counters;
    out.push_str(&format!(
        "\nTRAFFIC\n  submissions {} (rejected {})  hints {}\n  blocks stored {}  already present {}  not stored {}\n  blocks loaded {}  missing {}  failed {}  invalid {}\n  bytes stored {}  loaded {}\n  attachments accepted {}  refused {}\n",
        c.submissions,
        c.rejected_submissions,
        c.hints,
        c.blocks_stored,
        c.blocks_already_present,
        c.blocks_not_stored,
        c.blocks_loaded,
        c.blocks_missing,
        c.blocks_failed,
        c.blocks_invalid,
        bytes(c.bytes_stored as f64),
        bytes(c.bytes_loaded as f64),
        c.attachments_total,
        c.refusals
    ));
    out
}

/// The SSD tier: use, policy, what moved and what failed (docs/ssd.md).
pub fn ssd_section(out: &mut String, s: &SsdReport) {
    let cap = s.capacity_bytes as f64;
    out.push_str(&format!(
        "SSD\n  dirs {}\n  capacity {}  used {} ({:.1}%) in {} segments  live {}  watermarks low {} / high {}\n",
        s.dirs.join(", "),
        bytes(cap),
        bytes(s.bytes as f64),
        if cap > 0.0 { 100.0 * s.bytes as f64 / cap } else { 0.0 },
        s.segments,
        bytes(s.live_bytes as f64),
        s.low_watermark,
        s.high_watermark
    ));
    out.push_str(&format!(
        "  objects {}  admission {}  O_DIRECT {}  io_uring {}\n",
        s.objects,
        s.admission,
        if s.direct_io { "yes" } else { "no (buffered)" },
        if s.io_uring { "yes" } else { "no (pread/pwrite)" }
    ));
    out.push_str(&format!(
        "  demotions {} ({})  not admitted {}  failed {}\n  promotions {} ({})  failed {}\n",
        s.demotions,
        bytes(s.demoted_bytes as f64),
        s.not_admitted,
        s.demotion_failures,
        s.promotions,
        bytes(s.promoted_bytes as f64),
        s.promotion_failures
    ));
    out.push_str(&format!(
        "  CRC misses {}  read errors {}  write errors {}  evicted {}  compactions {}\n  warm restart: restored {} objects in {:.1} ms, torn records skipped {}, segments refused {}\n",
        s.crc_misses,
        s.read_errors,
        s.write_errors,
        s.evicted_objects,
        s.compactions,
        s.restored_objects,
        s.rebuild_ms,
        s.torn_records_skipped,
        s.segments_refused
    ));
    out.push_str(&format!(
        "  store: puts {} ({})  reads hit {} / miss {}  compacted {}\n  syncs: segments {}  directories {}{}\n  at start: segments from footer {}  scanned {}  unreadable {}  misplaced records {}\n\n",
        s.puts,
        bytes(s.put_bytes as f64),
        s.hits,
        s.misses,
        bytes(s.compacted_bytes as f64),
        s.segment_syncs,
        s.dir_syncs,
        if s.segment_syncs + s.dir_syncs == 0 { " (none yet: records written so far do not survive a power loss)" } else { "" },
        s.segments_from_footer,
        s.segments_scanned,
        s.segments_unreadable,
        s.misplaced_records
    ));
}

/// The cluster tier: peers, remote reads, and how peers are found (docs/cluster.md).
pub fn cluster_section(out: &mut String, c: &ClusterReport) {
    out.push_str(&format!(
        "CLUSTER\n  peers {}  subscribers {}  remote keys {}\n  fetches {} ({})  failed {}  digest mismatches {}  late reads {}\n",
        c.peers,
        c.subscribers,
        c.remote_keys,
        c.fetches,
        bytes(c.fetched_bytes as f64),
        c.fetch_failures,
        c.digest_mismatches,
        c.late_reads
    ));
    match &c.etcd {
        None => out.push_str("  membership: --cluster-peer list\n\n"),
        Some(e) => out.push_str(&format!(
            "  membership: etcd {}, last good poll {:.1} s ago, failed requests {}, outages {}\n  etcd members {}  this pool {} (registrations {})\n\n",
            if e.reachable { "reachable" } else { "UNREACHABLE (view kept)" },
            e.seconds_since_success,
            e.failed_requests,
            e.outages,
            e.members,
            if e.registered { "registered" } else { "NOT registered" },
            e.registrations
        )),
    }
}

/// Per-second rates between two reports.
pub fn rates(prev: &PoolReport, cur: &PoolReport, dt: Duration) -> Vec<(&'static str, f64)> {
    let secs = dt.as_secs_f64().max(1e-9);
    let d = |get: fn(&PoolReport) -> u64| get(cur).saturating_sub(get(prev)) as f64 / secs;
    let mut v = vec![
        ("stores/s", d(|r| r.counters.blocks_stored)),
        ("loads/s", d(|r| r.counters.blocks_loaded)),
        ("misses/s", d(|r| r.counters.blocks_missing)),
        ("store B/s", d(|r| r.counters.bytes_stored)),
        ("load B/s", d(|r| r.counters.bytes_loaded)),
        ("submissions/s", d(|r| r.counters.submissions)),
        ("pool wake-ups/s", d(|r| r.counters.service_wakeups)),
        ("hints/s", d(|r| r.counters.hints)),
        ("evictions/s", d(|r| r.pool.evictions)),
        ("events/s", d(|r| r.events.written)),
    ];
    if cur.ssd.is_some() {
        v.extend([
            ("demotions/s", d(|r| r.ssd.as_ref().map_or(0, |s| s.demotions))),
            ("promotions/s", d(|r| r.ssd.as_ref().map_or(0, |s| s.promotions))),
            ("SSD write B/s", d(|r| r.ssd.as_ref().map_or(0, |s| s.demoted_bytes))),
        ]);
    }
    v
}

/// One `watch` screen: rates first, then the dump.
pub fn watch_screen(cur: &PoolReport, prev: Option<(&PoolReport, Duration)>, interval: Duration) -> String {
    let mut out = format!("ringtool watch  (every {:.1} s, Ctrl-C to quit)  {}\n\nRATES\n", interval.as_secs_f64(), cur.socket);
    match prev {
        Some((p, dt)) => {
            let r = rates(p, cur, dt);
            let cell = |(name, v): &(&str, f64)| {
                if name.ends_with("B/s") {
                    format!("{name:<14}{:>12}/s", bytes(*v))
                } else {
                    format!("{name:<14}{v:>14.1}")
                }
            };
            for chunk in r.chunks(3) {
                out.push_str("  ");
                out.push_str(&chunk.iter().map(cell).collect::<Vec<_>>().join("    "));
                out.push('\n');
            }
            let loaded = r[1].1;
            let missed = r[2].1;
            if loaded + missed > 0.0 {
                out.push_str(&format!("  load hit ratio {:.1}%\n", 100.0 * loaded / (loaded + missed)));
            }
        }
        None => out.push_str("  (rates after the next refresh)\n"),
    }
    out.push('\n');
    out.push_str(&dump(cur));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ssd_section_shows_use_policy_traffic_and_failures() {
        let s = SsdReport::example();
        let mut out = String::new();
        ssd_section(&mut out, &s);
        for want in [
            "dirs /mnt/nvme0/umbp, /mnt/nvme1/umbp",
            "capacity 4.0 GiB  used 3.0 GiB (75.0%) in 13 segments  live 2.0 GiB",
            "objects 30  admission hit-or-young:60  O_DIRECT no (buffered)  io_uring yes",
            "demotions 77 (77.0 MiB)  not admitted 5  failed 2",
            "promotions 9 (9.0 MiB)  failed 1",
            "CRC misses 3  read errors 4  write errors 6  evicted 8  compactions 10",
            "restored 1000 objects in 12.5 ms, torn records skipped 11",
            "store: puts 14 (14.0 MiB)  reads hit 15 / miss 16  compacted 17.0 MiB",
            "syncs: segments 18  directories 19\n",
            "at start: segments from footer 20  scanned 21  unreadable 22  misplaced records 23",
        ] {
            assert!(out.contains(want), "{want:?} not in:\n{out}");
        }
    }

    #[test]
    fn cluster_section_shows_etcd_health() {
        let etcd = umbp_pool::pool_report::EtcdReport {
            reachable: false,
            seconds_since_success: 3.4,
            failed_requests: 9,
            outages: 1,
            registrations: 2,
            members: 3,
            registered: false,
        };
        let mut out = String::new();
        cluster_section(&mut out, &ClusterReport { peers: 2, etcd: Some(etcd), ..Default::default() });
        for want in [
            "peers 2",
            "membership: etcd UNREACHABLE (view kept), last good poll 3.4 s ago, failed requests 9, outages 1",
            "etcd members 3  this pool NOT registered (registrations 2)",
        ] {
            assert!(out.contains(want), "{want:?} not in:\n{out}");
        }
        let mut out = String::new();
        cluster_section(&mut out, &ClusterReport::default());
        assert!(out.contains("membership: --cluster-peer list"), "{out}");
    }
}
