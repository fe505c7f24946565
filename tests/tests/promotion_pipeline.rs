//! Pipelined promotion (pool/src/copy/promote.rs): a load whose objects are on a lower tier has
//! them fetched by the pool's promotion threads ahead of the stage its copy thread copies
//! (later stages; the peer's next queued loads). Loads in many stages stay byte-exact; a
//! fetch that fails in a later stage is a miss for those blocks only (nothing published);
//! a promotion thread that panics strands no object ("promoting", pinned) and the pool
//! keeps serving; a load cancelled mid-pipeline leaves no DRAM pinned or promoting.
//!
//! An in-process pool (fault injection) with a real SSD tier (segment files under
//! /var/tmp), a real worker over this process's memory; the remote case runs two pool
//! processes over NIXL (skips, printing why, without libnixl_capi.so).

mod common;
use common::*;

use std::time::{Duration, Instant};

use umbp_pool::{Pool, PoolConfig};
use umbp_protocol::ObjectKey;
use umbp_worker::{BlockStatus, CancelOutcome, MemorySpec, Segment, Worker, WorkerConfig};

/// One 64 KiB page per object; one object per copy stage.
const OBJECT: u64 = 64 << 10;
const DRAM: u64 = 16 << 20;
const BLOCKS: u64 = 64;
/// Blocks per load request: 16 stages.
const REQ: u64 = 16;
/// Keys stored: 4x DRAM, the older ones end up on SSD only.
const STORED: u64 = 4 * DRAM / OBJECT;

struct SsdPool {
    base: u128,
    pool: Pool,
    w: Worker,
    mem: Vec<u8>,
    _dir: tempfile::TempDir,
}

/// Each test's own keys (the fault hooks are process-wide; tests run in parallel).
fn key_in(base: u128, i: u64) -> ObjectKey {
    ObjectKey(base + i as u128)
}

impl SsdPool {
    fn start(tag: &str, base: u128, copy_threads: usize, timeout: Duration) -> SsdPool {
        let dir = tempfile::Builder::new().prefix("umbp-it-pipeline-").tempdir_in("/var/tmp").expect("tempdir in /var/tmp");
        let socket = unique_socket(tag);
        let ssd = small_ssd(dir.path());
        let pool = Pool::start(PoolConfig {
            socket_path: socket.clone(),
            capacity_bytes: DRAM,
            min_object_bytes: OBJECT,
            copy_threads,
            copy_stage_bytes: OBJECT,
            // Opt-in (off by default): what these tests exercise.
            promotion_ahead_bytes: 128 << 20,
            ssd: Some(ssd),
            ..Default::default()
        })
        .expect("pool starts");
        let mut cfg = WorkerConfig::new(&socket, 3);
        cfg.timeout = timeout;
        let mut w = Worker::connect(cfg).expect("worker attaches");
        let mem = vec![0u8; (BLOCKS * OBJECT) as usize];
        // SAFETY: `mem` lives in the `SsdPool` with `w` and is dropped after it is detached
        // (the test drops the pool and worker together); read and filled only between transfers.
        unsafe { w.register_memory(MemorySpec::HostProcess { ptr: mem.as_ptr() as usize, len: mem.len() }) }.unwrap();
        w.register_layout(0, vec![Segment::new(0, 0, OBJECT, OBJECT, BLOCKS)]).unwrap();
        let mut p = SsdPool { base, pool, w, mem, _dir: dir };
        p.store_all();
        p
    }

    fn key(&self, i: u64) -> ObjectKey {
        key_in(self.base, i)
    }

    fn block(&mut self, b: u64) -> &mut [u8] {
        &mut self.mem[(b * OBJECT) as usize..((b + 1) * OBJECT) as usize]
    }

    fn holds(&self, b: u64, k: ObjectKey) -> bool {
        let mut want = vec![0u8; OBJECT as usize];
        fill_pattern(k.0, &mut want);
        self.mem[(b * OBJECT) as usize..((b + 1) * OBJECT) as usize] == want[..]
    }

    /// Keys 0..STORED, 64 at a time; waits until at least half are on SSD only.
    fn store_all(&mut self) {
        for first in (0..STORED).step_by(BLOCKS as usize) {
            let batch: Vec<(ObjectKey, u64)> = (0..BLOCKS).map(|i| (self.key(first + i), i)).collect();
            for &(k, b) in &batch {
                fill_pattern(k.0, self.block(b));
            }
            let ok = eventually(Duration::from_secs(20), || {
                let id = self.w.store(0, &batch).expect("submit store");
                let c = self.w.wait(id, Duration::from_secs(10)).expect("store completes");
                c.statuses.iter().all(|s| matches!(s, BlockStatus::Stored | BlockStatus::AlreadyPresent))
            });
            assert!(ok, "keys {first}.. were never all stored");
        }
        wait_until("half of the keys to be on SSD", Duration::from_secs(30), || self.pool.report().tiers.ssd >= STORED / 2);
        // And the evictor done (DRAM below its high watermark: room for a request's 16
        // objects): a promotion finds room at once, so the look-ahead launches every one
        // (none is left to the copy thread's own promotion).
        wait_until("the evictor to bring DRAM below the high watermark", Duration::from_secs(30), || {
            let r = self.pool.report();
            r.pool.allocated_bytes as f64 <= r.pool.high_watermark * r.pool.capacity_bytes as f64
        });
    }

    /// Submits loads of keys `first..first + n` into blocks 0..n, `REQ` per request, all at
    /// once; the statuses in order. Blocks are zeroed first.
    fn load(&mut self, first: u64, n: u64) -> Vec<BlockStatus> {
        self.mem.fill(0);
        let mut ids = Vec::new();
        for r in (0..n).step_by(REQ as usize) {
            let batch: Vec<(ObjectKey, u64)> = (r..(r + REQ).min(n)).map(|i| (self.key(first + i), i)).collect();
            ids.push(self.w.load(0, &batch).expect("submit load"));
        }
        let mut st = Vec::new();
        for id in ids {
            st.extend(self.w.wait(id, Duration::from_secs(20)).expect("load completes").statuses);
        }
        for (i, s) in st.iter().enumerate() {
            if *s == BlockStatus::Loaded {
                assert!(self.holds(i as u64, self.key(first + i as u64)), "block {i} (key {}) loaded wrong bytes", first + i as u64);
            }
        }
        st
    }

    /// Nothing pinned, promoting or held ahead once the pool settled: every object is in
    /// exactly one tier's count, DRAM holds exactly the DRAM objects, none is pinned.
    fn assert_settled(&self) {
        let mut last = String::new();
        let ok = eventually(Duration::from_secs(10), || {
            let r = self.pool.report();
            last = format!(
                "pinned {} objects {} (dram {} ssd {}) allocated {} ahead {}",
                r.pool.pinned_objects, r.pool.objects, r.tiers.dram, r.tiers.ssd, r.pool.allocated_bytes, r.pool.promotion_ahead_bytes
            );
            r.pool.pinned_objects == 0
                && r.pool.promotion_ahead_bytes == 0
                && r.pool.objects == r.tiers.dram + r.tiers.ssd
                && r.pool.allocated_bytes == r.tiers.dram * OBJECT
        });
        assert!(ok, "the pool did not settle: {last}");
    }
}

fn count(st: &[BlockStatus], s: BlockStatus) -> usize {
    st.iter().filter(|x| **x == s).count()
}

#[test]
fn ssd_loads_in_many_stages_are_byte_exact_with_look_ahead() {
    let mut p = SsdPool::start("pipeline-ssd", 0x5eed_1000_0000, 2, Duration::from_secs(20));
    let before = p.pool.report();
    // The oldest half: on SSD. Four requests of 16 one-object stages at once.
    let st = p.load(0, BLOCKS);
    assert_eq!(count(&st, BlockStatus::Loaded), BLOCKS as usize, "{st:?}");
    let r = p.pool.report();
    let promoted = r.ssd.as_ref().unwrap().promotions - before.ssd.as_ref().unwrap().promotions;
    assert!(promoted >= BLOCKS / 2, "the load promoted from SSD ({promoted} promotions)");
    assert!(r.pool.promotions_ahead > before.pool.promotions_ahead, "promotions ran ahead of the copied stage: {:?}", r.pool);
    println!("{promoted} promotions, {} ahead of their stage", r.pool.promotions_ahead - before.pool.promotions_ahead);
    // The rest of the keys, then all again: still byte-exact (DRAM cycles through SSD).
    let st = p.load(BLOCKS, BLOCKS);
    assert_eq!(count(&st, BlockStatus::Loaded), BLOCKS as usize, "{st:?}");
    let st = p.load(0, BLOCKS);
    assert_eq!(count(&st, BlockStatus::Loaded), BLOCKS as usize, "{st:?}");
    p.assert_settled();
    p.pool.shutdown();
}

#[test]
fn a_failed_fetch_in_a_later_stage_misses_only_those_blocks() {
    let mut p = SsdPool::start("pipeline-fail", 0x5eed_2000_0000, 2, Duration::from_secs(20));
    // Keys 5 and 9 of the first request (stages 5 and 9) and 21 of the second (a load
    // queued behind it, whose promotions the first one's copy thread launches): the tier
    // reads them, then reports failure.
    let bad = [5u64, 9, 21];
    umbp_pool::fault::fail_fetch_of(bad.iter().map(|&i| p.key(i)).collect());
    let st = p.load(0, 2 * REQ);
    umbp_pool::fault::fail_fetch_of(Vec::new());
    for (i, s) in st.iter().enumerate() {
        if bad.contains(&(i as u64)) {
            assert_eq!(*s, BlockStatus::Missing, "block {i}: its fetch failed: {st:?}");
            assert!(
                p.mem[(i as u64 * OBJECT) as usize..((i as u64 + 1) * OBJECT) as usize].iter().all(|b| *b == 0),
                "block {i} was written"
            );
        } else {
            assert_eq!(*s, BlockStatus::Loaded, "block {i}: {st:?}");
        }
    }
    assert!(p.pool.report().pool.promotions_ahead > 0, "the failures were in promotions run ahead");
    // The failed promotions dropped those objects (never published what was read); the
    // others are in DRAM now.
    let st = p.load(0, 2 * REQ);
    for (i, s) in st.iter().enumerate() {
        let want = if bad.contains(&(i as u64)) { BlockStatus::Missing } else { BlockStatus::Loaded };
        assert_eq!(*s, want, "block {i} on the second load: {st:?}");
    }
    p.assert_settled();
    p.pool.shutdown();
}

#[test]
fn a_panicking_promotion_thread_strands_nothing_and_the_pool_keeps_serving() {
    // One copy thread: if a panic took it or left it waiting, everything after would hang.
    let mut p = SsdPool::start("pipeline-panic", 0x5eed_3000_0000, 1, Duration::from_secs(20));
    let victim = 7u64;
    umbp_pool::fault::panic_on_promotion_of(Some(p.key(victim)));
    let st = p.load(0, REQ);
    umbp_pool::fault::panic_on_promotion_of(None);
    assert_eq!(st[victim as usize], BlockStatus::Missing, "{st:?}");
    assert_eq!(st[0], BlockStatus::Loaded, "stage 0 was fetched before: {st:?}");
    assert_eq!(count(&st, BlockStatus::Loaded) + count(&st, BlockStatus::Missing), REQ as usize, "{st:?}");
    let failed = count(&st, BlockStatus::Missing);
    println!("the panicking batch took {failed} blocks with it");
    assert!(p.pool.report().ssd.unwrap().promotion_failures >= 1);
    p.assert_settled();
    // Not stuck: loads of the batch's keys answer at once (misses: the objects are gone),
    // the key can be stored again, the rest still loads byte-exact.
    let t = Instant::now();
    let again = p.load(0, REQ);
    assert!(t.elapsed() < Duration::from_millis(1500), "no wait for a stranded promotion: {:?}", t.elapsed());
    assert_eq!(again, st, "the same blocks load, the same miss");
    let k = p.key(victim);
    fill_pattern(k.0, p.block(0));
    let id = p.w.store(0, &[(k, 0)]).unwrap();
    let c = p.w.wait(id, Duration::from_secs(10)).expect("store completes");
    assert!(matches!(c.statuses[0], BlockStatus::Stored | BlockStatus::NotStored), "the key is not stuck in the index: {c:?}");
    let st = p.load(REQ, 2 * REQ);
    assert_eq!(count(&st, BlockStatus::Loaded), 2 * REQ as usize, "{st:?}");
    p.pool.shutdown();
}

#[test]
fn a_load_cancelled_mid_pipeline_leaves_no_dram_pinned_or_promoting() {
    let mut p = SsdPool::start("pipeline-cancel", 0x5eed_4000_0000, 1, Duration::from_millis(300));
    p.assert_settled();
    let baseline = p.pool.report();
    // Held after claiming stage 1 of 16: the look-ahead has launched later stages by then.
    let pause = umbp_pool::fault::pause_on_copy_of(p.key(1));
    p.mem.fill(0xee);
    let batch: Vec<(ObjectKey, u64)> = (0..REQ).map(|i| (p.key(i), i)).collect();
    let id = p.w.load(0, &batch).unwrap();
    assert!(pause.wait_reached(Duration::from_secs(10)), "the copy thread reached stage 1");
    let held = p.pool.report();
    let cancelled = p.w.cancel(id);
    pause.release();
    assert!(held.pool.promotion_ahead_bytes > 0, "promotions ran ahead of stage 1: {:?}", held.pool);
    assert_eq!(cancelled, CancelOutcome::Started);
    let c = p.w.wait(id, Duration::from_secs(10)).expect("completes once the pool goes on");
    assert_eq!(&c.statuses[..2], &[BlockStatus::Loaded; 2], "{c:?}");
    assert!(c.statuses[2..].iter().all(|s| *s == BlockStatus::Failed), "no stage after the abandon: {c:?}");
    assert!(p.mem[(2 * OBJECT) as usize..(REQ * OBJECT) as usize].iter().all(|b| *b == 0xee), "blocks of later stages never written");
    // The promotions it launched ahead end (published, unpinned): no DRAM pinned, held
    // ahead or promoting, and DRAM holds exactly its objects.
    p.assert_settled();
    let r = p.pool.report();
    assert!(r.ssd.as_ref().unwrap().promotions > baseline.ssd.as_ref().unwrap().promotions);
    println!(
        "DRAM allocated {} -> {} bytes ({} -> {} DRAM objects)",
        baseline.pool.allocated_bytes, r.pool.allocated_bytes, baseline.tiers.dram, r.tiers.dram
    );
    // And the pool keeps serving those keys.
    let st = p.load(0, REQ);
    assert_eq!(count(&st, BlockStatus::Loaded), REQ as usize, "{st:?}");
    p.pool.shutdown();
}

#[test]
fn remote_loads_in_many_stages_are_byte_exact_with_look_ahead() {
    if !cluster::nixl_on_loopback() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let secret = cluster::secret_file(dir.path(), b"pipelined-promotion-secret-0123456789");
    let (a1, a2) = (cluster::loopback_addr(), cluster::loopback_addr());
    let timing = cluster::Timing { heartbeat_ms: 200, dead_after_ms: 3000, read_timeout_ms: 5000 };
    let args = |me: &str, peer: &str| {
        cluster::pool_args(me, &[peer], &secret, timing, &["--copy-stage-size", "16KiB", "--promotion-ahead", "128MiB"])
    };
    let (args1, args2) = (args(&a1, &a2), args(&a2, &a1));
    let pool1 = PoolProcess::start(&unique_socket("pipe-clu1"), &args1.iter().map(String::as_str).collect::<Vec<_>>());
    let pool2 = PoolProcess::start(&unique_socket("pipe-clu2"), &args2.iter().map(String::as_str).collect::<Vec<_>>());
    let a = run_worker(&pool1.socket, 1, "per-layer", &["store", "--first-key", "0", "--count", "512"]);
    assert_eq!((n(&a, "stored"), n(&a, "failed")), (512, 0), "{a}");
    wait_until("pool 2 to list pool 1's blocks", Duration::from_secs(20), || pool2.report().tiers.remote == 512);
    // 16 KiB objects, one per stage: 8 requests of 64 stages.
    let b = run_worker(&pool2.socket, 1, "per-layer", &["load", "--first-key", "0", "--count", "512"]);
    assert_eq!((n(&b, "loaded"), n(&b, "corrupt"), n(&b, "missing"), n(&b, "failed")), (512, 0, 0, 0), "{b}");
    let r2 = pool2.report();
    assert_eq!((r2.tiers.dram, r2.tiers.remote), (512, 0), "{r2}");
    assert!(r2.pool.promotions_ahead > 0, "remote promotions ran ahead of the copied stage: {:?}", r2.pool);
    assert_eq!((r2.pool.pinned_objects, r2.pool.promotion_ahead_bytes), (0, 0), "{:?}", r2.pool);
    println!("pool 2: {} of 512 promotions ran ahead of their stage", r2.pool.promotions_ahead);
    // Local now: byte-exact again.
    let b = run_worker(&pool2.socket, 1, "strided", &["load", "--first-key", "0", "--count", "512"]);
    assert_eq!((n(&b, "loaded"), n(&b, "corrupt")), (512, 0), "{b}");
}
