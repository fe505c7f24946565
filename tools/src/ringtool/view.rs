//! Readable renderings of the pool report: `dump`'s tables and `watch`'s live screen.

use std::time::Duration;

use serde_json::Value;

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

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

fn s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
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

fn ring_cell(r: &Value) -> String {
    format!("{}/{}", u(&r["head"]), u(&r["tail"]))
}

fn short_ns(ns: &Value) -> String {
    let t = s(ns);
    if t.len() > 12 {
        format!("{}..{}", &t[..4], &t[t.len() - 4..])
    } else {
        t
    }
}

fn devices_cell(a: &Value) -> String {
    let Some(devs) = a["devices"].as_array() else { return "-".into() };
    if devs.is_empty() {
        return "-".into();
    }
    devs.iter()
        .map(|d| {
            let uuid = d["device_uuid"].as_str().map(|u| format!(" {}", &u[..8.min(u.len())])).unwrap_or_default();
            format!("#{} {}{} {}", u(&d["alloc_id"]), s(&d["kind"]), uuid, bytes(f(&d["bytes"])))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// `ringtool dump` without `--json`.
pub fn dump(r: &Value) -> String {
    let p = &r["pool"];
    let cap = f(&p["capacity_bytes"]);
    let alloc = f(&p["allocated_bytes"]);
    let mut out = format!(
        "umbp-pool {}  pid {}  protocol {}  socket {}\n  uptime {:.1} s  open fds {}\n\n",
        s(&r["version"]),
        s(&r["pid"]),
        s(&r["protocol_version"]),
        s(&r["socket"]),
        f(&r["uptime_s"]),
        s(&r["open_fds"])
    );
    out.push_str(&format!(
        "POOL\n  capacity {}  allocated {} ({:.1}%)  watermarks low {} / high {}\n  objects {}  published {}  pinned {}\n",
        bytes(cap),
        bytes(alloc),
        if cap > 0.0 { 100.0 * alloc / cap } else { 0.0 },
        s(&p["low_watermark"]),
        s(&p["high_watermark"]),
        s(&p["objects"]),
        s(&p["published_objects"]),
        s(&p["pinned_objects"])
    ));
    out.push_str(&format!(
        "  evictions {}  KV events written {} (log of {} entries)\n\n",
        s(&p["evictions"]),
        s(&r["events"]["written"]),
        s(&r["events"]["capacity"])
    ));
    let ns: Vec<Vec<String>> = r["namespaces"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|n| vec![s(&n["namespace"]), s(&n["objects"]), bytes(f(&n["bytes"]))])
        .collect();
    out.push_str(&format!("NAMESPACES ({})\n", ns.len()));
    if !ns.is_empty() {
        out.push_str(&table(&["namespace", "objects", "bytes"], &ns, 2));
    }
    let atts: Vec<Vec<String>> = r["attachments"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|a| {
            vec![
                s(&a["id"]),
                s(&a["pid"]),
                s(&a["role"]),
                short_ns(&a["namespace"]),
                format!("{}/{}", s(&a["tp_rank"]), s(&a["tp_size"])),
                ring_cell(&a["sq"]),
                ring_cell(&a["cq"]),
                ring_cell(&a["hints"]),
                s(&a["inflight"]),
                format!(
                    "{}/{}",
                    if a["sq"]["need_wakeup"] == true { "sq" } else { "-" },
                    if a["cq"]["need_wakeup"] == true { "cq" } else { "-" }
                ),
                s(&a["submissions"]),
                s(&a["blocks"]),
                s(&a["errors"]),
                bytes(f(&a["registered_bytes"])),
                devices_cell(a),
            ]
        })
        .collect();
    out.push_str(&format!("\nATTACHMENTS ({})\n", atts.len()));
    if !atts.is_empty() {
        out.push_str(&table(
            &[
                "id", "pid", "role", "namespace", "tp", "sq h/t", "cq h/t", "hints h/t", "inflight", "wakeup", "subm",
                "blocks", "errors", "registered", "devices",
            ],
            &atts,
            2,
        ));
    }
    let ix = &r["index"];
    if !ix.is_null() {
        let slots = f(&ix["slots"]);
        out.push_str(&format!(
            "\nINDEX\n  slots {}  live {} ({:.1}% occupied)  tombstones {}  epoch {}  inserts {}  removes {}  rebuilds {}\n",
            s(&ix["slots"]),
            s(&ix["live"]),
            if slots > 0.0 { 100.0 * f(&ix["live"]) / slots } else { 0.0 },
            s(&ix["tombstones"]),
            s(&ix["epoch"]),
            s(&ix["inserts"]),
            s(&ix["removes"]),
            s(&ix["rebuilds"])
        ));
        let hist: Vec<String> = ix["probe_histogram"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
            .map(|(i, n)| format!("{i}{}:{}", if i == 7 { "+" } else { "" }, s(n)))
            .collect();
        out.push_str(&format!("  probe lengths  {}\n", hist.join("  ")));
    }
    // With --namespace-acl: one index and event log per tenant group (the INDEX above is
    // their sum).
    let groups = r["groups"].as_array().map(Vec::as_slice).unwrap_or_default();
    if groups.len() > 1 {
        out.push_str("\nTENANT GROUPS (own index and event log each)\n");
        for g in groups {
            let list = |v: &serde_json::Value| {
                let items: Vec<String> = v.as_array().into_iter().flatten().map(|x| x.to_string().trim_matches('"').to_string()).collect();
                if items.is_empty() { "-".to_string() } else { items.join(",") }
            };
            out.push_str(&format!(
                "  group {}  uids {}  namespaces {}\n    index slots {}  live {}  tombstones {}  inserts {}  removes {}  events written {}\n",
                s(&g["group"]),
                if g["group"] == 0 { "(pool's, root)".to_string() } else { list(&g["uids"]) },
                if g["group"] == 0 { "(not listed)".to_string() } else { list(&g["namespaces"]) },
                s(&g["index"]["slots"]),
                s(&g["index"]["live"]),
                s(&g["index"]["tombstones"]),
                s(&g["index"]["inserts"]),
                s(&g["index"]["removes"]),
                s(&g["events"]["written"]),
            ));
        }
    }
    let c = &r["counters"];
    out.push_str(&format!(
        "\nTRAFFIC\n  submissions {} (rejected {})  hints {}\n  blocks stored {}  already present {}  not stored {}\n  blocks loaded {}  missing {}  failed {}  invalid {}\n  bytes stored {}  loaded {}\n  attachments accepted {}  refused {}\n",
        s(&c["submissions"]),
        s(&c["rejected_submissions"]),
        s(&c["hints"]),
        s(&c["blocks_stored"]),
        s(&c["blocks_already_present"]),
        s(&c["blocks_not_stored"]),
        s(&c["blocks_loaded"]),
        s(&c["blocks_missing"]),
        s(&c["blocks_failed"]),
        s(&c["blocks_invalid"]),
        bytes(f(&c["bytes_stored"])),
        bytes(f(&c["bytes_loaded"])),
        s(&c["attachments_total"]),
        s(&c["refusals"])
    ));
    out
}

/// Per-second rates between two reports.
pub fn rates(prev: &Value, cur: &Value, dt: Duration) -> Vec<(&'static str, f64)> {
    let secs = dt.as_secs_f64().max(1e-9);
    let d = |path: &[&str]| {
        let get = |r: &Value| path.iter().fold(r, |v, k| &v[*k]).as_f64().unwrap_or(0.0);
        (get(cur) - get(prev)).max(0.0) / secs
    };
    vec![
        ("stores/s", d(&["counters", "blocks_stored"])),
        ("loads/s", d(&["counters", "blocks_loaded"])),
        ("misses/s", d(&["counters", "blocks_missing"])),
        ("store B/s", d(&["counters", "bytes_stored"])),
        ("load B/s", d(&["counters", "bytes_loaded"])),
        ("submissions/s", d(&["counters", "submissions"])),
        ("hints/s", d(&["counters", "hints"])),
        ("evictions/s", d(&["pool", "evictions"])),
        ("events/s", d(&["events", "written"])),
    ]
}

/// One `watch` screen: rates first, then the dump.
pub fn watch_screen(cur: &Value, prev: Option<(&Value, Duration)>, interval: Duration) -> String {
    let mut out = format!(
        "ringtool watch  (every {:.1} s, Ctrl-C to quit)  {}\n\nRATES\n",
        interval.as_secs_f64(),
        s(&cur["socket"])
    );
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
