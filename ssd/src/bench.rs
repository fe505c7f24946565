//! Measurements for `umbp-bench ssd` (the lead wires the subcommand): the store's write and
//! read throughput beside raw io_uring O_DIRECT of the same bytes in the same directory,
//! and warm-restart time.

use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::Instant;

use umbp_protocol::ObjectKey;

use super::config::SsdConfig;
use super::error::SsdError;
use super::format::align_up;
use super::store::SsdStore;
use super::uring::{ReadJob, Ring, WriteJob};

#[derive(Debug, Clone, serde::Serialize)]
pub struct SsdBench {
    pub dir: String,
    pub direct_io: bool,
    pub bytes: u64,
    pub object_bytes: u64,
    pub queue_depth: u32,
    pub batch: usize,
    pub ssd_write_gbps: f64,
    pub ssd_read_gbps: f64,
    pub raw_write_gbps: f64,
    pub raw_read_gbps: f64,
    pub write_speedup: f64,
    pub read_speedup: f64,
    pub objects_rebuilt: u64,
    /// `SsdStore::open` on the written directory: rings, buffer registration, rebuild.
    pub open_ms: f64,
    /// The rebuild part of it (footers, index).
    pub warm_restart_ms: f64,
    pub warm_restart_ms_per_million: f64,
    pub warm_restart_hits: f64,
}

fn gbps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

fn pattern(i: u64, buf: &mut [u8]) {
    for (j, w) in buf.chunks_mut(8).enumerate() {
        let v = (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ j as u64).to_le_bytes();
        w.copy_from_slice(&v[..w.len()]);
    }
}

/// Writes then reads `total` bytes as `object` -sized objects through the store (in batches
/// of `batch`) and through a raw ring on one O_DIRECT file in `dir`; then drops the store,
/// reopens it, and times the rebuild and checks every object is still there.
pub fn run(dir: &Path, total: u64, object: u64, batch: usize, cfg: &SsdConfig) -> Result<SsdBench, SsdError> {
    let n = (total / object).max(1);
    let total = n * object;
    let mut payloads: Vec<Vec<u8>> = Vec::with_capacity(batch);
    for i in 0..batch as u64 {
        let mut v = vec![0u8; object as usize];
        pattern(i, &mut v);
        payloads.push(v);
    }
    let store_dir = dir.join("store");
    let raw_path = dir.join("raw.bin");
    std::fs::create_dir_all(&store_dir).map_err(|e| SsdError::Io { path: store_dir.clone(), what: "mkdir".into(), source: e })?;
    let mut cfg = cfg.clone();
    cfg.dirs = vec![store_dir.clone()];
    cfg.capacity_bytes = cfg.capacity_bytes.max(total * 2 + cfg.segment_bytes * 4);

    // Raw io_uring O_DIRECT: the same objects (no headers), same depth and chunk size.
    let rec = align_up(object);
    let raw = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&raw_path)
            .map_err(|e| SsdError::Io { path: raw_path.clone(), what: "opening raw file (O_DIRECT)".into(), source: e })?
    };
    let mut ring =
        Ring::new(cfg.queue_depth, cfg.chunk_bytes, true).map_err(|source| SsdError::Uring { path: raw_path.clone(), source })?;
    let fd = raw.as_raw_fd();
    let t = Instant::now();
    let mut i = 0u64;
    while i < n {
        let m = (n - i).min(batch as u64);
        let jobs: Vec<WriteJob<'_>> =
            (0..m).map(|k| WriteJob { fd, offset: (i + k) * rec, len: rec, pieces: vec![&payloads[k as usize][..]] }).collect();
        for r in ring.write_batch(&jobs) {
            r.map_err(|e| SsdError::Io { path: raw_path.clone(), what: "raw write".into(), source: e })?;
        }
        i += m;
    }
    let raw_write = t.elapsed().as_secs_f64();
    // Interleaved (raw write, store write, raw read, store read) so a busy disk's drift
    // affects both sides alike.
    // The store.
    let store = SsdStore::open(&cfg)?;
    let key = |i: u64| ObjectKey(((i as u128) << 64) | (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) as u128));
    let t = Instant::now();
    let mut i = 0u64;
    while i < n {
        let m = (n - i).min(batch as u64);
        let items: Vec<(ObjectKey, u128, u64, &[u8])> = (0..m).map(|k| (key(i + k), 1u128, object, &payloads[k as usize][..])).collect();
        for r in store.put_batch(&items) {
            r?;
        }
        i += m;
    }
    let ssd_write = t.elapsed().as_secs_f64();

    // Both reads land in the same preallocated destinations (like the pool's DRAM
    // allocations a promotion reads into), written before timing so no page faults count.
    let mut dests: Vec<Vec<u8>> = (0..batch).map(|_| vec![1u8; object as usize]).collect();
    // The raw read runs before and after the store's read (a disk or host cache that
    // favours recent or repeated reads then favours raw too); the faster pass counts.
    let mut sink_bytes = 0u64;
    let mut raw_pass = |dests: &mut Vec<Vec<u8>>| -> Result<f64, SsdError> {
        let t = Instant::now();
        let mut i = 0u64;
        while i < n {
            let m = (n - i).min(batch as u64);
            let outs = &mut dests[..m as usize];
            {
                let mut sinks: Vec<Box<super::uring::Sink<'_>>> = outs
                    .iter_mut()
                    .map(|o| {
                        Box::new(move |at: u64, d: &[u8]| {
                            let end = (at as usize + d.len()).min(o.len());
                            if (at as usize) < end {
                                o[at as usize..end].copy_from_slice(&d[..end - at as usize]);
                            }
                        }) as Box<super::uring::Sink<'_>>
                    })
                    .collect();
                let mut jobs: Vec<ReadJob<'_>> = sinks
                    .iter_mut()
                    .enumerate()
                    .map(|(k, s)| ReadJob { fd, offset: (i + k as u64) * rec, len: rec, sink: &mut **s })
                    .collect();
                for r in ring.read_batch(&mut jobs) {
                    r.map_err(|e| SsdError::Io { path: raw_path.clone(), what: "raw read".into(), source: e })?;
                }
            }
            sink_bytes += outs.iter().map(|o| o[0] as u64).sum::<u64>();
            i += m;
        }
        Ok(t.elapsed().as_secs_f64())
    };
    let raw_read_1 = raw_pass(&mut dests)?;
    let t = Instant::now();
    let mut i = 0u64;
    let mut found = 0u64;
    while i < n {
        let m = (n - i).min(batch as u64);
        let keys: Vec<(ObjectKey, u128)> = (0..m).map(|k| (key(i + k), 1)).collect();
        let mut refs: Vec<&mut [u8]> = dests[..m as usize].iter_mut().map(|d| &mut d[..]).collect();
        found += store.get_batch_into(&keys, &mut refs).iter().filter(|r| r.is_some()).count() as u64;
        i += m;
    }
    let ssd_read = t.elapsed().as_secs_f64();
    let raw_read = raw_read_1.min(raw_pass(&mut dests)?);
    drop(raw);
    let _ = std::fs::remove_file(&raw_path);
    std::hint::black_box(sink_bytes);
    let direct = store.stats().direct_io;
    drop(store);
    if found != n {
        tracing::warn!(found, n, "SSD bench: not every object read back");
    }

    // Warm restart: rebuild from footers (the store sealed its segments on drop).
    let t = Instant::now();
    let store = SsdStore::open(&cfg)?;
    let open_ms = t.elapsed().as_secs_f64() * 1000.0;
    let rebuild = store.stats().rebuild_ms;
    let objects = store.stats().objects;
    let mut hits = 0u64;
    let sample = n.min(256);
    for s in 0..sample {
        let i = s * n / sample;
        if let Some((_, d)) = store.get(key(i), 1) {
            hits += (d == payloads[(i % batch as u64) as usize]) as u64;
        }
    }
    drop(store);
    let _ = std::fs::remove_dir_all(&store_dir);
    Ok(SsdBench {
        dir: dir.display().to_string(),
        direct_io: direct,
        bytes: total,
        object_bytes: object,
        queue_depth: cfg.queue_depth,
        batch,
        ssd_write_gbps: gbps(total, ssd_write),
        ssd_read_gbps: gbps(total, ssd_read),
        raw_write_gbps: gbps(total, raw_write),
        raw_read_gbps: gbps(total, raw_read),
        write_speedup: raw_write / ssd_write,
        read_speedup: raw_read / ssd_read,
        objects_rebuilt: objects,
        open_ms,
        warm_restart_ms: rebuild,
        warm_restart_ms_per_million: rebuild * 1e6 / objects.max(1) as f64,
        warm_restart_hits: hits as f64 / sample as f64,
    })
}
