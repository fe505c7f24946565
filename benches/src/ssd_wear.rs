//! `umbp-bench ssd` admission cases: one store/re-hit workload, larger than DRAM, run by an
//! in-process pool with an SSD tier under each admission policy (`all`, `hit`,
//! `hit-or-young`, `never`); per policy the bytes the pool wrote to SSD (drive wear) and
//! the hit rate of the re-hits that found their object out of DRAM.
//!
//! Workload (one real worker, one host memfd): `stream` keys of `object` bytes stored in
//! batches, 8x DRAM in all. One key in 8 is *hot*: loaded once right after its batch is
//! stored (a hit while in DRAM, which `hit` and `hit-or-young` count). One key in 8 is a
//! *late* re-hit: never loaded until the end. After the stream, every hot and late key is
//! loaded again; by then most left DRAM, so a hit there came from SSD (or DRAM).

use std::path::Path;
use std::time::{Duration, Instant};

use umbp_pool::{Pool, PoolConfig};
use umbp_ssd::{SsdAdmission, SsdConfig};
use umbp_worker::{BlockStatus, ObjectKey, Segment, Worker, WorkerConfig};

use crate::report::{Better, Case};

/// The workload's sizes.
pub struct WearArgs {
    /// Pool DRAM.
    pub dram_bytes: u64,
    pub object_bytes: u64,
    /// Stored bytes as a multiple of DRAM.
    pub stream_factor: u64,
}

/// One policy's outcome.
#[derive(Debug, Clone, serde::Serialize)]
pub struct WearResult {
    pub policy: String,
    pub stored_bytes: u64,
    /// Bytes the pool wrote to SSD (demotions), the drive's wear.
    pub ssd_written_bytes: u64,
    pub written_fraction_of_stored: f64,
    pub rehits: u64,
    /// Re-hits (hot and late) that loaded: from DRAM or promoted from SSD.
    pub rehit_hit_rate: f64,
    pub hot_hit_rate: f64,
    pub late_hit_rate: f64,
    /// Re-hits served by promotion from SSD.
    pub promotions: u64,
    pub not_admitted: u64,
    pub seconds: f64,
}

const BATCH: u64 = 64;

fn wait_ok(w: &mut Worker, id: umbp_worker::TransferId) -> Result<Vec<BlockStatus>, String> {
    w.wait(id, Duration::from_secs(60)).map(|c| c.statuses).ok_or_else(|| "transfer did not complete in 60 s".to_string())
}

/// Stores `keys` (block i of the memfd for key i), retrying the ones that found no room
/// while the evictor demotes.
fn store(w: &mut Worker, keys: &[u128]) -> Result<(), String> {
    let mut todo: Vec<(ObjectKey, u64)> = keys.iter().enumerate().map(|(i, k)| (ObjectKey(*k), i as u64)).collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !todo.is_empty() {
        if Instant::now() > deadline {
            return Err(format!("{} stores found no room for 60 s", todo.len()));
        }
        let id = w.store(0, &todo).map_err(|e| e.to_string())?;
        let st = wait_ok(w, id)?;
        if st.contains(&BlockStatus::Failed) {
            return Err(format!("store failed: {st:?}"));
        }
        todo = todo.into_iter().zip(st).filter(|(_, s)| *s == BlockStatus::NotStored).map(|(b, _)| b).collect();
        if !todo.is_empty() {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    Ok(())
}

/// Loads `keys`; how many loaded.
fn load(w: &mut Worker, keys: &[u128]) -> Result<u64, String> {
    let mut loaded = 0;
    for chunk in keys.chunks(BATCH as usize) {
        let blocks: Vec<(ObjectKey, u64)> = chunk.iter().enumerate().map(|(i, k)| (ObjectKey(*k), i as u64)).collect();
        let id = w.load(0, &blocks).map_err(|e| e.to_string())?;
        loaded += wait_ok(w, id)?.iter().filter(|s| **s == BlockStatus::Loaded).count() as u64;
    }
    Ok(loaded)
}

fn run_policy(dir: &Path, args: &WearArgs, admission: SsdAdmission, name: &str) -> Result<WearResult, String> {
    let started = Instant::now();
    let ssd_dir = dir.join(name.replace(':', "-"));
    std::fs::create_dir_all(&ssd_dir).map_err(|e| format!("{}: {e}", ssd_dir.display()))?;
    let object = args.object_bytes;
    let keys = (args.dram_bytes * args.stream_factor / object).max(BATCH);
    let socket = std::env::temp_dir().join(format!("umbp-bench-wear-{}-{}.sock", std::process::id(), name.replace(':', "-")));
    let ssd = SsdConfig {
        dirs: vec![ssd_dir.clone()],
        capacity_bytes: (keys * object * 2).max(256 << 20),
        segment_bytes: 16 << 20,
        admission,
        ..Default::default()
    };
    let pool = Pool::start(PoolConfig {
        socket_path: socket.clone(),
        capacity_bytes: args.dram_bytes,
        min_object_bytes: object,
        ssd: Some(ssd),
        ..Default::default()
    })
    .map_err(|e| e.to_string())?;
    let mut w = Worker::connect(WorkerConfig::new(&socket, 1)).map_err(|e| e.to_string())?;
    let kv = umbp_ipc::SharedMemory::create("umbp-bench-wear", (object * BATCH) as usize, false).map_err(|e| e.to_string())?;
    let fd = kv.fd().try_clone_to_owned().map_err(|e| e.to_string())?;
    let alloc = w.register_memfd(fd, 0, object * BATCH).map_err(|e| e.to_string())?;
    w.register_layout(0, vec![Segment::new(alloc, 0, object, object, BATCH)]).map_err(|e| e.to_string())?;

    let hot = |k: u128| k % 8 == 3;
    let late = |k: u128| k % 8 == 6;
    let mut first = 0u128;
    while first < keys as u128 {
        let batch: Vec<u128> = (first..(first + BATCH as u128).min(keys as u128)).collect();
        store(&mut w, &batch)?;
        let hot_keys: Vec<u128> = batch.iter().copied().filter(|k| hot(*k)).collect();
        load(&mut w, &hot_keys)?;
        first += BATCH as u128;
    }
    let before = pool.report().ssd.ok_or("no SSD tier in the report")?;
    let hot_keys: Vec<u128> = (0..keys as u128).filter(|k| hot(*k)).collect();
    let late_keys: Vec<u128> = (0..keys as u128).filter(|k| late(*k)).collect();
    let hot_hits = load(&mut w, &hot_keys)?;
    let late_hits = load(&mut w, &late_keys)?;
    let after = pool.report().ssd.ok_or("no SSD tier in the report")?;
    drop(w);
    pool.shutdown();
    let _ = std::fs::remove_dir_all(&ssd_dir);
    let rehits = (hot_keys.len() + late_keys.len()) as u64;
    let stored = keys * object;
    Ok(WearResult {
        policy: name.to_string(),
        stored_bytes: stored,
        // Written while the stream ran (the re-hit phase's own demotions are not counted:
        // they depend on what the re-hits displaced, not on the stream).
        ssd_written_bytes: before.demoted_bytes,
        written_fraction_of_stored: before.demoted_bytes as f64 / stored as f64,
        rehits,
        rehit_hit_rate: (hot_hits + late_hits) as f64 / rehits as f64,
        hot_hit_rate: hot_hits as f64 / hot_keys.len().max(1) as f64,
        late_hit_rate: late_hits as f64 / late_keys.len().max(1) as f64,
        promotions: after.promotions - before.promotions,
        not_admitted: before.not_admitted,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// Runs the workload under every policy in `dir` (a scratch directory) and returns one
/// written-bytes case and one hit-rate case per policy (docs/benchmarks.md convention).
pub fn run(dir: &Path, args: &WearArgs) -> Result<Vec<Case>, String> {
    let policies =
        [("all", SsdAdmission::All), ("hit", SsdAdmission::Hit), ("hit-or-young", SsdAdmission::default()), ("never", SsdAdmission::Never)];
    let mut results = Vec::new();
    for (name, p) in policies {
        results.push(run_policy(dir, args, p, name)?);
    }
    let all = results[0].clone();
    let mut cases = Vec::new();
    for r in results {
        let ctx = serde_json::to_value(&r).map_err(|e| e.to_string())?;
        let ctx = ctx.as_object().cloned().unwrap_or_default();
        let base = "policy all, same workload";
        cases.push(
            Case::new(
                "ssd",
                &format!("admission_{}_ssd_written_bytes", r.policy),
                r.ssd_written_bytes as f64,
                "bytes",
                all.ssd_written_bytes as f64,
                base,
                Better::Lower,
            )
            .extra("dram_bytes", args.dram_bytes)
            .extra("object_bytes", args.object_bytes)
            .extras(&ctx),
        );
        cases.push(
            Case::new(
                "ssd",
                &format!("admission_{}_rehit_hit_rate", r.policy),
                r.rehit_hit_rate,
                "fraction",
                all.rehit_hit_rate,
                base,
                Better::Higher,
            )
            .extra("dram_bytes", args.dram_bytes)
            .extras(&ctx),
        );
    }
    Ok(cases)
}
