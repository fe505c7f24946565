//! `umbp-bench index`: the shared index at production size, read the way a scheduler
//! reads it, against a std `HashMap` lookup measured in the same run.
//!
//! A table sized like the pool sizes it ([`slots_for`]: twice the most objects, a power
//! of two) lives in a sealed memfd and is filled with `entries` random 128-bit keys (what
//! xxh3 keys look like). Cases:
//! * `match_prefix_per_key`: `match_prefix` over `keys` present keys (all hit), time per
//!   key; baseline: `HashMap::contains_key` over the same keys with the same stop-at-first-
//!   miss loop.
//! * `miss`: `lookup` of absent keys, time per lookup; baseline: `HashMap::get` of the
//!   same keys.
//! * `match_prefix_per_key_vs_fxhash`, `miss_vs_fxhash`: the same index figures against a
//!   `rustc_hash::FxHashMap` (a fast non-cryptographic hash, no SipHash cost) holding the
//!   same entries: the honest in-process baseline.
//!
//! * `match_prefix_cold_per_key`: `match_prefix` over `keys` present keys that no round
//!   touched recently (every round takes another of the table's `entries / keys` disjoint
//!   key sets, in a scattered order), time per key; baseline: the same cold lookups one
//!   key after the other (`lookup` until the first miss, what `match_prefix` did before
//!   it loaded each window's home slots together), on other sets in the same rounds. A
//!   10k-token restore's lookup is this case.
//!
//! Each round times the whole key list once; the reported value is the median round
//! divided by the number of keys. Except in the cold case, the key lists are small
//! enough to stay in cache after the first round, so these are warm-cache figures.

use std::collections::HashMap;
use std::hint::black_box;
use std::io;
use std::time::Instant;

use rustc_hash::FxHashMap;

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Map, Value};
use umbp_protocol::index::{region_bytes, slots_for, IndexView, IndexWriter};
use umbp_protocol::ObjectKey;

use super::report::{cpus, Better, Case};
use umbp_ipc::SharedMemory;

#[derive(Debug, Clone)]
pub struct IndexArgs {
    /// Entries in the table.
    pub entries: u64,
    /// Keys per `match_prefix` call (and miss keys per round).
    pub keys: usize,
    /// Timed rounds per case.
    pub iterations: usize,
    /// Smallest object the pool sizes its table for (the `slots_for` divisor).
    pub min_object_bytes: u64,
}

/// splitmix64: deterministic, well-mixed keys without a dependency.
struct Keys(u64);

impl Keys {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn next_key(&mut self) -> ObjectKey {
        ObjectKey::from_words([self.next_u64(), self.next_u64()])
    }
}

fn median_per_key(mut rounds: Vec<u64>, keys: usize) -> f64 {
    rounds.sort_unstable();
    rounds[rounds.len() / 2] as f64 / keys as f64
}

fn time_rounds(iterations: usize, mut f: impl FnMut()) -> Vec<u64> {
    // One untimed round to warm caches and branch predictors.
    f();
    (0..iterations)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_nanos() as u64
        })
        .collect()
}

pub fn run(args: &IndexArgs) -> io::Result<Vec<Case>> {
    let slots = slots_for(args.entries.saturating_mul(args.min_object_bytes), args.min_object_bytes);
    let len = region_bytes(slots);
    let map = SharedMemory::create("umbp-bench-index", len, false).map_err(io::Error::other)?;
    // SAFETY: the mapping is fresh (zeroed) and outlives the view and writer below.
    let view = unsafe { IndexView::init(map.as_ptr(), len, slots) }.map_err(io::Error::other)?;
    let mut writer = IndexWriter::new(view);
    let mut hash = HashMap::<u128, u64>::with_capacity(args.entries as usize);
    let mut fx = FxHashMap::<u128, u64>::with_capacity_and_hasher(args.entries as usize, Default::default());

    let bar = ProgressBar::new(args.entries);
    bar.set_style(ProgressStyle::with_template("fill     [{bar:40}] {pos}/{len} entries").unwrap());
    let mut gen = Keys(0x0123_4567_89ab_cdef);
    let stride = (args.entries / args.keys as u64).max(1);
    let mut present = Vec::with_capacity(args.keys);
    // The cold case's disjoint key sets: key i goes to set i % sets.
    let sets = (args.entries as usize / args.keys.max(1)).max(1);
    let mut cold_sets: Vec<Vec<ObjectKey>> = vec![Vec::with_capacity(args.keys); sets];
    let fill = Instant::now();
    for i in 0..args.entries {
        let k = gen.next_key();
        let loc = i.wrapping_mul(64 << 10);
        writer.insert(k, loc).map_err(|e| io::Error::other(format!("{e} (raise --min-object-bytes or lower --entries)")))?;
        hash.insert(k.0, loc);
        fx.insert(k.0, loc);
        if cold_sets[i as usize % sets].len() < args.keys {
            cold_sets[i as usize % sets].push(k);
        }
        if i % stride == 0 && present.len() < args.keys {
            present.push(k);
        }
        if i % 65536 == 65535 {
            bar.inc(65536);
        }
    }
    bar.finish_and_clear();
    let fill_ns_per_insert = fill.elapsed().as_nanos() as f64 / args.entries.max(1) as f64;
    let mut absent = Vec::with_capacity(args.keys);
    while absent.len() < args.keys {
        let k = gen.next_key();
        if !hash.contains_key(&k.0) {
            absent.push(k);
        }
    }
    let n = present.len();

    // A scheduler reads through its own (read-only in production) attachment.
    // SAFETY: the mapping outlives the reader view.
    let reader = unsafe { IndexView::attach(map.as_ptr(), len) }.map_err(io::Error::other)?;
    if reader.match_prefix(&present) != n || absent.iter().any(|k| reader.lookup(*k).is_some()) {
        return Err(io::Error::other("index does not hold what was inserted"));
    }

    let idx_prefix = time_rounds(args.iterations, || {
        black_box(reader.match_prefix(black_box(&present)));
    });
    let map_prefix = time_rounds(args.iterations, || {
        black_box(black_box(&present).iter().take_while(|k| hash.contains_key(&k.0)).count());
    });
    let fx_prefix = time_rounds(args.iterations, || {
        black_box(black_box(&present).iter().take_while(|k| fx.contains_key(&k.0)).count());
    });
    let fx_miss = time_rounds(args.iterations, || {
        for k in black_box(&absent) {
            black_box(fx.get(&k.0));
        }
    });
    let idx_miss = time_rounds(args.iterations, || {
        for k in black_box(&absent) {
            black_box(reader.lookup(*k));
        }
    });
    let map_miss = time_rounds(args.iterations, || {
        for k in black_box(&absent) {
            black_box(hash.get(&k.0));
        }
    });

    // Cold: round r takes set r * 7919 % sets for the windowed match and the set half the
    // table away for the one-by-one baseline, so neither warms the other's lines.
    let (mut cold, mut cold_base) = (Vec::with_capacity(args.iterations), Vec::with_capacity(args.iterations));
    let cold_keys = cold_sets[0].len();
    for r in 0..args.iterations {
        let a = &cold_sets[r * 7919 % sets];
        let b = &cold_sets[(r * 7919 + sets / 2) % sets];
        let t = Instant::now();
        let hits = reader.match_prefix(black_box(a));
        cold.push(t.elapsed().as_nanos() as u64);
        let t = Instant::now();
        let base_hits = black_box(b).iter().take_while(|k| reader.lookup(**k).is_some()).count();
        cold_base.push(t.elapsed().as_nanos() as u64);
        if hits != a.len() || base_hits != b.len() {
            return Err(io::Error::other("cold lookups missed keys the index holds"));
        }
    }

    let hist = reader.probe_histogram(64);
    let mean_probe = hist.iter().enumerate().map(|(d, c)| (d as u64 + 1) * c).sum::<u64>() as f64 / hist.iter().sum::<u64>().max(1) as f64;
    let mut extra = Map::new();
    extra.insert("entries".into(), Value::from(args.entries));
    extra.insert("slots".into(), Value::from(slots));
    extra.insert("load".into(), Value::from((args.entries as f64 / slots as f64 * 1000.0).round() / 1000.0));
    extra.insert("keys".into(), Value::from(n));
    extra.insert("rounds".into(), Value::from(args.iterations));
    extra.insert("mean_probe_slots".into(), Value::from((mean_probe * 1000.0).round() / 1000.0));
    extra.insert("fill_ns_per_insert".into(), Value::from(fill_ns_per_insert.round()));
    extra.insert("cpus".into(), Value::from(cpus()));
    let (idx_prefix, idx_miss) = (median_per_key(idx_prefix, n), median_per_key(idx_miss, n));
    const FX: &str = "rustc-hash FxHashMap lookup (non-cryptographic hash, private memory)";
    Ok(vec![
        Case::new(
            "index",
            "match_prefix_per_key",
            idx_prefix,
            "ns",
            median_per_key(map_prefix, n),
            "std HashMap lookup (SipHash, private memory)",
            Better::Lower,
        )
        .extras(&extra),
        Case::new(
            "index",
            "miss",
            idx_miss,
            "ns",
            median_per_key(map_miss, n),
            "std HashMap lookup (SipHash, private memory)",
            Better::Lower,
        )
        .extras(&extra),
        Case::new(
            "index",
            "match_prefix_cold_per_key",
            median_per_key(cold, cold_keys),
            "ns",
            median_per_key(cold_base, cold_keys),
            "the same cold lookups one key after the other (lookup until the first miss)",
            Better::Lower,
        )
        .extras(&extra)
        .extra("key_sets", sets),
        Case::new("index", "match_prefix_per_key_vs_fxhash", idx_prefix, "ns", median_per_key(fx_prefix, n), FX, Better::Lower)
            .extras(&extra),
        Case::new("index", "miss_vs_fxhash", idx_miss, "ns", median_per_key(fx_miss, n), FX, Better::Lower).extras(&extra),
    ])
}
