//! `ringtool inspect --fd /proc/PID/fd/N`: maps a shared region of a live process
//! read-only (`PROT_READ`, only atomic loads: the process is never disturbed), recognises
//! it from its header and prints what is in it.
//!
//! | region | how it is recognised |
//! |---|---|
//! | attachment ring memfd | `MAGIC` at 0 and the SQ entry size (64) at byte 8 |
//! | index memfd | `MAGIC` at 0, a slot count at byte 8 that `IndexView::attach` accepts |
//! | event log memfd | `MAGIC` at 0 and the tag `"EVTL"` at byte 8 |

use std::os::fd::AsFd;
use std::path::Path;

use serde_json::{json, Value};
use umbp_protocol::attachment::{AttachmentLayout, Hint};
use umbp_protocol::entries::{Cqe, Sqe};
use umbp_protocol::events::{EntryRead, EventLog, EVENT_LOG_TAG};
use umbp_protocol::index::IndexView;
use umbp_protocol::ring::{ring_bytes, Ring, RingHeader};
use umbp_protocol::MAGIC;

/// A read-only shared mapping of a whole file, unmapped on drop.
struct ReadOnlyMap {
    ptr: *mut u8,
    len: usize,
}

impl ReadOnlyMap {
    fn open(path: &Path) -> Result<Self, String> {
        let file = std::fs::File::open(path).map_err(|e| format!("{}: cannot open read-only: {e}", path.display()))?;
        let len = file.metadata().map_err(|e| format!("{}: {e}", path.display()))?.len() as usize;
        if len < 64 {
            return Err(format!("{}: {len} bytes is too small for any UMBP region", path.display()));
        }
        // SAFETY: a new read-only shared mapping at a kernel-chosen address; the pool's
        // regions are size-sealed, so it cannot shrink under us (no SIGBUS).
        let ptr = unsafe {
            rustix::mm::mmap(std::ptr::null_mut(), len, rustix::mm::ProtFlags::READ, rustix::mm::MapFlags::SHARED, file.as_fd(), 0)
        }
        .map_err(|e| format!("{}: mmap failed: {e}", path.display()))?;
        Ok(Self { ptr: ptr.cast(), len })
    }

    fn u32_at(&self, off: usize) -> u32 {
        // SAFETY: off + 4 <= len (callers stay in the first 64 bytes, checked in open);
        // the header words are naturally aligned atomics in the writer's layout.
        unsafe { (*(self.ptr.add(off) as *const std::sync::atomic::AtomicU32)).load(std::sync::atomic::Ordering::Acquire) }
    }
}

impl Drop for ReadOnlyMap {
    fn drop(&mut self) {
        // SAFETY: mapped in `open` with this length; no borrow outlives `self`.
        let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) };
    }
}

fn seals(path: &Path) -> Value {
    let Ok(f) = std::fs::File::open(path) else { return Value::Null };
    match rustix::fs::fcntl_get_seals(&f) {
        Ok(s) => json!(format!("{s:?}")),
        Err(_) => json!("none (not a memfd)"),
    }
}

fn ring_json<T: bytemuck::Pod>(map: &ReadOnlyMap, offset: usize, name: &str) -> Result<(Value, usize), String> {
    if offset + std::mem::size_of::<RingHeader>() > map.len {
        return Err(format!("{name} ring header at {offset} is past the end ({} bytes)", map.len));
    }
    // SAFETY: inside the mapping; Ring::attach checks the header and that `capacity`
    // entries fit in the remaining length. Only `snapshot` (atomic loads) is used.
    let ring = unsafe { Ring::<T>::attach(map.ptr.add(offset), map.len - offset) }.map_err(|e| format!("{name} ring at {offset}: {e}"))?;
    let s = ring.snapshot();
    Ok((
        json!({
            "offset": offset, "capacity": s.capacity, "head": s.head, "tail": s.tail,
            "pending": s.len(), "need_wakeup": s.need_wakeup,
            "corrupt": s.len() > s.capacity,
        }),
        ring_bytes::<T>(s.capacity),
    ))
}

fn page_up(n: usize) -> usize {
    n.div_ceil(4096) * 4096
}

/// Inspects the region at `path`; `events` = how many latest events to list for an event
/// log, `keys` = how many live index entries to list (with their tier) for an index.
pub fn inspect(path: &Path, events: usize, keys: usize) -> Result<Value, String> {
    let map = ReadOnlyMap::open(path)?;
    let magic = map.u32_at(0);
    if magic != MAGIC {
        return Err(format!("{}: not a UMBP region (first word {magic:#010x}, expected {MAGIC:#010x} \"UMBP\")", path.display()));
    }
    let word2 = map.u32_at(8);
    let common = json!({ "path": path.display().to_string(), "bytes": map.len, "seals": seals(path) });
    let mut out = if word2 == EVENT_LOG_TAG {
        // SAFETY: read-only mapping alive for this scope; attach validates the header.
        let log = unsafe { EventLog::attach(map.ptr, map.len) }.map_err(|e| format!("{}: event log: {e}", path.display()))?;
        let head = log.head();
        let first = head.saturating_sub(events as u64);
        let recent: Vec<Value> = (first..head)
            .filter_map(|n| match log.read_event(n) {
                EntryRead::Event(e) => Some(json!({
                    "seq": e.seq, "kind": e.kind.as_str(), "tier": e.tier.as_str(), "key": format!("{:032x}", e.key.0),
                })),
                _ => None,
            })
            .collect();
        json!({ "region": "event_log", "capacity": log.capacity(), "written": head, "recent": recent })
    } else if word2 as usize == std::mem::size_of::<Sqe>() {
        let (sq, sq_bytes) = ring_json::<Sqe>(&map, 0, "SQ")?;
        let cq_off = page_up(sq_bytes);
        let (cq, cq_bytes) = ring_json::<Cqe>(&map, cq_off, "CQ")?;
        let hint_off = page_up(cq_off + cq_bytes);
        let (hints, hint_bytes) = ring_json::<Hint>(&map, hint_off, "hint")?;
        let arena_off = page_up(hint_off + hint_bytes);
        let arena = map.len.saturating_sub(arena_off);
        let consistent = AttachmentLayout::new(
            sq["capacity"].as_u64().unwrap_or(0) as u32,
            cq["capacity"].as_u64().unwrap_or(0) as u32,
            hints["capacity"].as_u64().unwrap_or(0) as u32,
            arena as u64,
        )
        .is_ok_and(|l| l.total_bytes == map.len);
        json!({
            "region": "attachment_rings",
            "sq": sq, "cq": cq, "hints": hints,
            "arena": { "offset": arena_off, "bytes": arena },
            "layout_consistent": consistent,
        })
    } else {
        // SAFETY: read-only mapping alive for this scope; attach validates every field.
        let view = unsafe { IndexView::attach(map.ptr, map.len) }
            .map_err(|e| format!("{}: neither a ring, an event log nor an index: {e}", path.display()))?;
        let s = view.snapshot();
        // SAFETY: `map` is the region `view` was attached to, alive for this scope.
        let tiers = unsafe { crate::ringtool::tiers::scan(&view, map.ptr, map.len, keys) }.to_json();
        json!({
            "region": "index",
            "slots": s.slot_count, "epoch": s.epoch, "active_table": s.epoch & 1,
            "live": s.live, "tombstones": s.tombstones,
            "load": s.live as f64 / s.slot_count as f64,
            "inserts": s.inserts, "removes": s.removes, "rebuilds": s.rebuilds,
            "probe_histogram": view.probe_histogram(8),
            "tiers": tiers["tiers"], "unreadable_slots": tiers["unreadable_slots"],
            "tiers_approximate": tiers["approximate"], "keys": tiers["keys"],
        })
    };
    if let (Value::Object(o), Value::Object(c)) = (&mut out, common) {
        for (k, v) in c {
            o.insert(k, v);
        }
    }
    Ok(out)
}

/// Readable rendering of `inspect`'s JSON.
pub fn render(v: &Value) -> String {
    let mut s = format!(
        "{}: {} ({} bytes, seals {})\n",
        v["path"].as_str().unwrap_or("?"),
        v["region"].as_str().unwrap_or("?"),
        v["bytes"],
        v["seals"].as_str().unwrap_or("?")
    );
    match v["region"].as_str() {
        Some("attachment_rings") => {
            s.push_str("  ring   offset     capacity  head        tail        pending  need_wakeup\n");
            for name in ["sq", "cq", "hints"] {
                let r = &v[name];
                s.push_str(&format!(
                    "  {:<6} {:<10} {:<9} {:<11} {:<11} {:<8} {}{}\n",
                    name,
                    r["offset"].to_string(),
                    r["capacity"].to_string(),
                    r["head"].to_string(),
                    r["tail"].to_string(),
                    r["pending"].to_string(),
                    r["need_wakeup"],
                    if r["corrupt"] == true { "  CORRUPT (tail - head > capacity)" } else { "" }
                ));
            }
            s.push_str(&format!(
                "  arena  offset {} bytes {}; layout consistent: {}\n",
                v["arena"]["offset"], v["arena"]["bytes"], v["layout_consistent"]
            ));
        }
        Some("index") => {
            s.push_str(&format!(
                "  slots {}  live {}  tombstones {}  load {:.3}  epoch {} (active table {})\n  inserts {}  removes {}  rebuilds {}\n  probe lengths (0..7+): {}\n",
                v["slots"], v["live"], v["tombstones"], v["load"].as_f64().unwrap_or(0.0), v["epoch"], v["active_table"],
                v["inserts"], v["removes"], v["rebuilds"], v["probe_histogram"]
            ));
            let t = &v["tiers"];
            s.push_str(&format!(
                "  tiers: dram {}  ssd {}  remote {}{}{}\n",
                t["dram"],
                t["ssd"],
                t["remote"],
                if t["unknown"].as_u64().unwrap_or(0) > 0 { format!("  unknown {}", t["unknown"]) } else { String::new() },
                if v["tiers_approximate"] == true { "  (approximate: the index was rebuilt meanwhile)" } else { "" }
            ));
            let keys = v["keys"].as_array().map(Vec::as_slice).unwrap_or_default();
            if !keys.is_empty() {
                s.push_str("  key                               tier     location\n");
                for k in keys {
                    let loc = k.get("payload").map_or_else(|| k["raw"].as_str().unwrap_or("?").to_string(), |p| p.to_string());
                    s.push_str(&format!("  {}  {:<7}  {}\n", k["key"].as_str().unwrap_or("?"), k["tier"].as_str().unwrap_or("?"), loc));
                }
            }
        }
        Some("event_log") => {
            s.push_str(&format!("  capacity {}  events written {}\n", v["capacity"], v["written"]));
            for e in v["recent"].as_array().into_iter().flatten() {
                s.push_str(&format!(
                    "  #{:<10} {:<8} {:<7} {}\n",
                    e["seq"],
                    e["kind"].as_str().unwrap_or("?"),
                    e["tier"].as_str().unwrap_or("?"),
                    e["key"].as_str().unwrap_or("?")
                ));
            }
        }
        _ => {}
    }
    s
}
