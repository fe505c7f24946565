//! Which tier holds each object of an index: a walk over the active table of an index
//! region (read-only, atomic loads through the slots' seqlocks), decoding each live
//! entry's location word (`umbp_protocol::location`). `inspect` and `dump` print it.

use serde_json::{json, Value};
use umbp_protocol::index::{IndexSlot, IndexView, SLOT_FULL};
use umbp_protocol::location::{self, Tier};
use umbp_protocol::ObjectKey;

/// Live entries by tier, and the first few of them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierScan {
    /// Live entries per tier, in `Tier::ALL` order (dram, ssd, remote).
    pub counts: [u64; 3],
    /// Live entries whose location names a tier this build does not know (a newer pool).
    pub unknown: u64,
    /// Slots the writer kept busy through every retry (not counted above).
    pub unreadable: u64,
    /// Whether the index was rebuilt (epoch changed) during every attempt: counts are then
    /// approximate.
    pub approximate: bool,
    /// The first `list` live entries in table order: key, location word.
    pub entries: Vec<(ObjectKey, u64)>,
}

impl TierScan {
    pub fn count(&self, t: Tier) -> u64 {
        self.counts[t as usize]
    }

    pub fn total(&self) -> u64 {
        self.counts.iter().sum::<u64>() + self.unknown
    }

    pub fn to_json(&self) -> Value {
        let mut by_tier = serde_json::Map::new();
        for t in Tier::ALL {
            by_tier.insert(t.as_str().into(), json!(self.count(t)));
        }
        by_tier.insert("unknown".into(), json!(self.unknown));
        json!({
            "tiers": by_tier,
            "unreadable_slots": self.unreadable,
            "approximate": self.approximate,
            "keys": self.entries.iter().map(|(k, loc)| entry_json(*k, *loc)).collect::<Vec<_>>(),
        })
    }
}

/// One listed key: its hex, tier and the location's payload (DRAM: byte offset).
pub fn entry_json(key: ObjectKey, loc: u64) -> Value {
    let mut v = crate::ringtool::decode::location_json(loc);
    v["key"] = json!(format!("{:032x}", key.0));
    v
}

/// Walks the active table of the index `view` describes.
///
/// # Safety
/// `mem` is the start of the region `view` was attached to (`IndexView::attach(mem, len)`),
/// valid for reads of `len` bytes for the duration of the call.
pub unsafe fn scan(view: &IndexView<'_>, mem: *const u8, len: usize, list: usize) -> TierScan {
    let header = view.header();
    let slots = view.slot_count() as usize;
    let mut out = TierScan::default();
    for attempt in 0..4 {
        let epoch = header.epoch.load(std::sync::atomic::Ordering::Acquire);
        let off = header.info.table_offset[(epoch & 1) as usize].load(std::sync::atomic::Ordering::Relaxed) as usize;
        // `attach` checked both offsets; they are written once at format time. Check again
        // anyway rather than trust a peer's header twice.
        let end = off.checked_add(slots * std::mem::size_of::<IndexSlot>());
        if !off.is_multiple_of(32) || end.is_none_or(|e| e > len) {
            return out;
        }
        // SAFETY: [off, off + slots * 32) lies inside the region (checked above), is
        // 32-aligned, and IndexSlot is all atomics, valid for any bit pattern; the caller
        // keeps the mapping alive for this call.
        let table = unsafe { std::slice::from_raw_parts(mem.add(off) as *const IndexSlot, slots) };
        let mut scan = TierScan::default();
        for slot in table {
            let Some(c) = IndexView::read_slot(slot) else {
                scan.unreadable += 1;
                continue;
            };
            if c.state != SLOT_FULL {
                continue;
            }
            match location::decode(c.location) {
                Some((t, _)) => scan.counts[t as usize] += 1,
                None => scan.unknown += 1,
            }
            if scan.entries.len() < list {
                scan.entries.push((c.key, c.location));
            }
        }
        out = scan;
        if header.epoch.load(std::sync::atomic::Ordering::Acquire) == epoch {
            return out;
        }
        out.approximate = attempt == 3;
    }
    out
}

/// One line per tier with a count, e.g. `dram 10  ssd 32  remote 0`.
pub fn summary_line(counts: impl IntoIterator<Item = (&'static str, u64)>) -> String {
    counts.into_iter().map(|(t, n)| format!("{t} {n}")).collect::<Vec<_>>().join("  ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use umbp_protocol::index::{region_bytes, IndexWriter};

    /// A region in a Vec, aligned for the index header.
    fn region(slots: u64) -> (Vec<u128>, *mut u8, usize) {
        let len = region_bytes(slots);
        let mut v = vec![0u128; len / 16 + 8];
        let p = ((v.as_mut_ptr() as usize + 127) & !127) as *mut u8;
        (v, p, len)
    }

    #[test]
    fn counts_every_tier_and_lists_keys_with_their_tier() {
        let (_buf, p, len) = region(1024);
        // SAFETY: p..p + len lies inside _buf (8 spare words cover the alignment), which
        // lives to the end of the test; nothing else uses it.
        let view = unsafe { IndexView::init(p, len, 1024) }.unwrap();
        let mut w = IndexWriter::new(view);
        for i in 0..10u128 {
            w.insert(ObjectKey(i + 1), location::encode(Tier::Dram, (i as u64) << 16)).unwrap();
        }
        for i in 0..32u128 {
            w.insert(ObjectKey(1000 + i), location::encode(Tier::Ssd, i as u64)).unwrap();
        }
        w.insert(ObjectKey(5000), location::encode(Tier::Remote, 3)).unwrap();
        w.insert(ObjectKey(6000), 15 << 60).unwrap();
        // Removed entries (tombstones) are not counted.
        w.remove(ObjectKey(1000));
        // SAFETY: the region `view` was attached to, alive for the call.
        let s = unsafe { scan(&view, p, len, 100) };
        assert_eq!((s.count(Tier::Dram), s.count(Tier::Ssd), s.count(Tier::Remote), s.unknown), (10, 31, 1, 1));
        assert_eq!(s.total(), 43);
        assert_eq!(s.entries.len(), 43);
        assert!(!s.approximate && s.unreadable == 0);
        let j = s.to_json();
        assert_eq!(j["tiers"]["ssd"], 31);
        let listed: Vec<_> = j["keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| (k["key"].as_str().unwrap().to_string(), k["tier"].as_str().unwrap().to_string()))
            .collect();
        assert!(listed.contains(&(format!("{:032x}", 1005u128), "ssd".into())), "{listed:?}");
        assert!(listed.contains(&(format!("{:032x}", 1u128), "dram".into())));
        assert!(listed.contains(&(format!("{:032x}", 5000u128), "remote".into())));
        assert!(listed.contains(&(format!("{:032x}", 6000u128), "unknown".into())));
        // A listing limit keeps the counts whole.
        // SAFETY: as above.
        let s = unsafe { scan(&view, p, len, 3) };
        assert_eq!((s.entries.len(), s.total()), (3, 43));
        // After a rebuild (the other table is active) the counts are the same.
        w.rebuild();
        // SAFETY: as above.
        let s = unsafe { scan(&view, p, len, 0) };
        assert_eq!((s.count(Tier::Dram), s.count(Tier::Ssd), s.count(Tier::Remote), s.unknown), (10, 31, 1, 1));
        assert_eq!(summary_line([("dram", 1), ("ssd", 2)]), "dram 1  ssd 2");
    }
}
