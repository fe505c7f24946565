//! `umbp-bench transfer --backend cuda --multi-gpu`: one pool serving one worker process per
//! GPU (each started with `CUDA_VISIBLE_DEVICES` set to its GPU, so each sees "device 0"
//! and the pool tells them apart by UUID), as a TP2 engine would run.
//!
//! Checks (JSON lines like `--check`): both ranks store a 10k-token prefix under per-rank
//! keys (`ObjectKey::derive(namespace, group, rank, block hash)`, as the vLLM connector
//! makes them) and restore it byte-exact into poisoned memory; a scheduler's prefix lookup
//! counts only the blocks every rank holds (the connector's rule: the minimum over ranks).
//! Cases: store and load GB/s of each GPU alone and of all GPUs at once (aggregate), the
//! aggregate against one GPU alone, beside the host's memcpy rate with one thread per CPU.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use umbp_worker::ObjectKey;

use super::report::{Better, Case};
use super::transfer::checks::Checks;
use super::transfer::command::{Command, Op, Xfer};
use super::transfer::parent::{start_pool, WorkerProc};
use super::transfer::{gbps, gpt_oss, median, u64_of, BackendArg, TransferArgs, NS};

/// Synthetic vLLM block hashes of prefix `run` (32 bytes each, like sha256 block hashes).
fn block_hashes(run: u64, n: usize) -> Vec<[u8; 32]> {
    (0..n as u64)
        .map(|i| {
            let mut h = [0u8; 32];
            h[..8].copy_from_slice(&run.to_le_bytes());
            h[8..16].copy_from_slice(&i.to_le_bytes());
            h
        })
        .collect()
}

fn rank_keys(rank: u32, hashes: &[[u8; 32]]) -> Vec<ObjectKey> {
    hashes.iter().map(|h| ObjectKey::derive(NS, 0, rank, h)).collect()
}

fn hex_keys(keys: &[ObjectKey]) -> Vec<String> {
    keys.iter().map(|k| format!("{:x}", k.0)).collect()
}

/// Sends the same kind of command to every worker at once and collects the replies, so the
/// GPUs work concurrently.
fn all_at_once(workers: &mut [WorkerProc], cmd: impl Fn(usize) -> Command) -> Result<Vec<Value>, String> {
    for (i, w) in workers.iter_mut().enumerate() {
        w.send(&cmd(i))?;
    }
    workers.iter_mut().map(WorkerProc::recv).collect()
}

/// Bytes copied per second by `threads` threads each memcpy-ing its own 256 MiB buffer:
/// what the host memory system gives CPU copies (each byte read and written once).
fn host_memcpy_gbps(threads: usize) -> f64 {
    const LEN: usize = 256 << 20;
    let mut bufs: Vec<(Vec<u8>, Vec<u8>)> = (0..threads).map(|_| (vec![1u8; LEN], vec![0u8; LEN])).collect();
    let mut best = 0.0f64;
    for _ in 0..3 {
        let t = Instant::now();
        std::thread::scope(|s| {
            for (src, dst) in bufs.iter_mut() {
                s.spawn(move || {
                    dst.copy_from_slice(src);
                    std::hint::black_box(dst);
                });
            }
        });
        best = best.max(gbps((threads * LEN) as u64, t.elapsed().as_nanos() as u64));
    }
    best
}

pub fn run(args: &TransferArgs) -> Result<Vec<Case>, String> {
    if args.backend != BackendArg::Cuda {
        return Err("--multi-gpu needs --backend cuda".into());
    }
    let gpus = umbp_gpu::cuda::device_count().map_err(|e| format!("--multi-gpu: {e}"))? as usize;
    if gpus < 2 {
        return Err(format!("--multi-gpu needs at least 2 GPUs; the CUDA driver sees {gpus}"));
    }
    let pool = start_pool(args)?;
    let mut workers = Vec::with_capacity(gpus);
    let mut names = Vec::with_capacity(gpus);
    for g in 0..gpus {
        let mut w =
            WorkerProc::spawn_with_env(&format!("gpu{g}"), &pool.socket, BackendArg::Cuda, NS, &[("CUDA_VISIBLE_DEVICES", g.to_string())])?;
        names.push(w.call(&Command::Info)?["gpu"].clone());
        workers.push(w);
    }
    let l = gpt_oss();
    let (n, bytes) = (l.blocks.len(), l.bytes());
    for (g, w) in workers.iter_mut().enumerate() {
        l.setup(w, 0, 100 + g as u64)?;
    }
    let mut c = Checks { cases: Vec::new(), failed: 0 };

    // TP ranks store the same prefix under their own keys, then restore it byte-exact.
    let hashes = block_hashes(1, n);
    let keys: Vec<Vec<ObjectKey>> = (0..gpus as u32).map(|r| rank_keys(r, &hashes)).collect();
    let xfer = |op: Op, keys: &[ObjectKey]| Command::Xfer(Xfer { keys: Some(hex_keys(keys)), ..Xfer::new(op, 0, 0, &l.blocks, n, 1) });
    let stored = all_at_once(&mut workers, |r| xfer(Op::Store, &keys[r]))?;
    let mut index = umbp_scheduler::IndexClient::connect(&pool.socket, NS, Duration::from_secs(5)).map_err(|e| e.to_string())?;
    let per_rank: Vec<usize> = keys.iter().map(|k| index.match_prefix(k)).collect();
    let tp_hit = per_rank.iter().copied().min().unwrap_or(0);
    for w in workers.iter_mut() {
        w.call(&Command::Poison { group: 0 })?;
    }
    let loaded = all_at_once(&mut workers, |r| xfer(Op::Load, &keys[r]))?;
    let mut verified = Vec::new();
    for (g, w) in workers.iter_mut().enumerate() {
        verified.push(w.call(&Command::Verify { group: 0, seed: 100 + g as u64, blocks: l.blocks.clone() })?);
    }
    let exact = verified.iter().all(|v| u64_of(v, "bad_words") == 0 && u64_of(v, "words") > 0);
    let all_ok = stored.iter().chain(&loaded).all(|r| u64_of(r, "bad") == 0 && u64_of(r, "ok") == n as u64);
    c.record(
        "tp_ranks_store_and_restore_byte_exact",
        exact && all_ok && tp_hit == n,
        json!({"gpus": names, "blocks_per_rank": n, "lookup_hits_per_rank": per_rank, "verify": verified}),
    );
    // A prefix only one rank stored in full is a hit only as far as every rank holds it.
    let partial = block_hashes(2, n);
    let part_keys: Vec<Vec<ObjectKey>> = (0..gpus as u32).map(|r| rank_keys(r, &partial)).collect();
    let short = n / 3;
    let replies = all_at_once(&mut workers, |r| {
        let upto = if r == 0 { n } else { short };
        Command::Xfer(Xfer { keys: Some(hex_keys(&part_keys[r][..upto])), ..Xfer::new(Op::Store, 0, 0, &l.blocks[..upto], upto, 1) })
    })?;
    let per_rank: Vec<usize> = part_keys.iter().map(|k| index.match_prefix(k)).collect();
    let tp = per_rank.iter().copied().min().unwrap_or(0);
    c.record(
        "tp_lookup_needs_every_rank",
        replies.iter().all(|r| u64_of(r, "bad") == 0) && per_rank[0] == n && tp == short,
        json!({"lookup_hits_per_rank": per_rank, "tp_hit": tp, "expected": short}),
    );
    drop(index);

    // Bandwidth: each GPU alone, then all at once; fresh keys each time.
    let reps = args.reps.max(1);
    let mut run = 10u64;
    let mut fresh = |gpu: usize| {
        run += 1;
        rank_keys(gpu as u32, &block_hashes(run, n))
    };
    let mut alone: Vec<(f64, f64)> = Vec::new();
    for (g, w) in workers.iter_mut().enumerate() {
        let (mut st, mut ld) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            w.call(&Command::Reset)?;
            let k = fresh(g);
            st.push(gbps(bytes, u64_of(&w.call(&xfer(Op::Store, &k))?, "ns")));
            ld.push(gbps(bytes, u64_of(&w.call(&xfer(Op::Load, &k))?, "ns")));
        }
        alone.push((median(st), median(ld)));
    }
    let (mut st, mut ld) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        workers[0].call(&Command::Reset)?;
        let k: Vec<Vec<ObjectKey>> = (0..gpus).map(&mut fresh).collect();
        let s = all_at_once(&mut workers, |g| xfer(Op::Store, &k[g]))?;
        let d = all_at_once(&mut workers, |g| xfer(Op::Load, &k[g]))?;
        if s.iter().chain(&d).any(|r| u64_of(r, "bad") != 0) {
            return Err(format!("concurrent transfers failed: {s:?} {d:?}"));
        }
        let slowest = |v: &[Value]| v.iter().map(|r| u64_of(r, "ns")).max().unwrap_or(1);
        st.push(gbps(gpus as u64 * bytes, slowest(&s)));
        ld.push(gbps(gpus as u64 * bytes, slowest(&d)));
    }
    let cpus = super::report::cpus();
    let memcpy = host_memcpy_gbps(cpus);
    let memcpy_one = host_memcpy_gbps(1);
    for (op, aggregate, single) in [("store", median(st), alone[0].0), ("load", median(ld), alone[0].1)] {
        let each: Vec<f64> = alone.iter().map(|a| if op == "store" { a.0 } else { a.1 }).collect();
        c.cases.push(
            Case::new(
                "transfer",
                &format!("multigpu_{op}_gbps"),
                aggregate,
                "GB/s",
                single,
                "GPU 0 alone, same layout and bytes",
                Better::Higher,
            )
            .extra("gpus", gpus)
            .extra("gpu_names", names.clone())
            .extra("alone_gbps", each)
            .extra("host_memcpy_gbps_all_cpus", memcpy)
            .extra("host_memcpy_gbps_one_thread", memcpy_one)
            .extra("cpus", cpus)
            .extra("layout", "24 layers x 64 KiB pages (gpt-oss-20b-like), one allocation per layer, 313 blocks per GPU")
            .extra("bytes_per_gpu", bytes),
        );
    }
    if c.failed > 0 {
        super::report::print(&c.cases, true);
        return Err(format!("{} multi-GPU check(s) failed", c.failed));
    }
    Ok(c.cases)
}
