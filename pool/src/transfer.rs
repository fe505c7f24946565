//! Copy threads: execute the copies of one submission through the device backends, then
//! publish (stores) or unpin (loads) and post the completion.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use umbp_protocol::entries::{BlockStatus, Cqe, Opcode, Sqe};
use umbp_protocol::layout::{push_coalesced, CopyOp, KvLayout};
use umbp_protocol::ObjectKey;

use crate::attachment::Attachment;
use crate::stats::Counters;
use crate::PoolInner;

pub struct JobBlock {
    /// Position in the submission (and in `statuses`).
    pub index: usize,
    pub key: ObjectKey,
    pub block_id: u64,
    /// Object offset in DRAM.
    pub offset: u64,
}

pub struct Job {
    pub att: Arc<Attachment>,
    pub sqe: Sqe,
    pub op: Opcode,
    pub layout: Arc<KvLayout>,
    /// Blocks that need a copy; the others already have their status.
    pub blocks: Vec<JobBlock>,
    pub statuses: Vec<BlockStatus>,
}

pub fn run_copy_thread(inner: &PoolInner, rx: crossbeam_channel::Receiver<Job>) {
    loop {
        let job = match rx.recv_timeout(std::time::Duration::from_millis(100)) {
            Ok(job) => job,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) if !inner.is_shutting_down() => continue,
            Err(_) => return,
        };
        if !job.att.is_alive() || inner.is_shutting_down() {
            finish_cancelled(inner, job);
            continue;
        }
        let failed = copy(inner, &job);
        finish(inner, job, &failed);
    }
}

/// Runs the copies; returns the submission positions of blocks whose copy failed.
fn copy(inner: &PoolInner, job: &Job) -> Vec<usize> {
    // Group copies per allocation (one backend call each), remembering which blocks use it.
    let mut per_alloc: HashMap<u32, (Vec<CopyOp>, Vec<usize>)> = HashMap::new();
    let mut ops = Vec::new();
    for b in &job.blocks {
        ops.clear();
        job.layout.plan_block(b.block_id, b.offset, &mut ops).expect("block ids are checked at submission");
        for op in &ops {
            let entry = per_alloc.entry(op.alloc_id).or_default();
            push_coalesced(&mut entry.0, *op);
            if entry.1.last() != Some(&b.index) {
                entry.1.push(b.index);
            }
        }
    }
    let regions = job.att.regions.read().expect("regions lock").clone();
    let mut failed = Vec::new();
    let started = Instant::now();
    for (alloc, (ops, users)) in per_alloc {
        let Some(region) = regions.get(&alloc) else {
            failed.extend(users);
            continue;
        };
        let r = match job.op {
            // SAFETY: every op's host range is an object reserved (store) or pinned (load)
            // for this job in the object store, inside DRAM; nobody else writes it meanwhile.
            Opcode::Store => unsafe { region.copy_to_host(&ops, inner.dram.base()) },
            // SAFETY: as above.
            Opcode::Load => unsafe { region.copy_from_host(&ops, inner.dram.base()) },
            Opcode::Nop => Ok(()),
        };
        if let Err(e) = r {
            tracing::warn!(attachment = job.att.id, alloc, "copy failed: {e}");
            failed.extend(users);
        }
    }
    let ns = started.elapsed().as_nanos() as u64;
    match job.op {
        Opcode::Store => Counters::add(&inner.counters.store_copy_ns, ns),
        _ => Counters::add(&inner.counters.load_copy_ns, ns),
    }
    failed.sort_unstable();
    failed.dedup();
    failed
}

/// Publishes or unpins, writes per-block statuses and posts the completion.
pub fn finish(inner: &PoolInner, mut job: Job, failed: &[usize]) {
    let size = job.layout.object_bytes();
    {
        let mut store = inner.store.lock().expect("store lock");
        for b in &job.blocks {
            let ok = failed.binary_search(&b.index).is_err();
            job.statuses[b.index] = match job.op {
                Opcode::Store => {
                    if store.finish_store(b.key, ok) {
                        BlockStatus::Stored
                    } else if ok {
                        BlockStatus::NotStored
                    } else {
                        BlockStatus::Failed
                    }
                }
                _ => {
                    store.finish_load(b.key);
                    if ok { BlockStatus::Loaded } else { BlockStatus::Failed }
                }
            };
        }
    }
    let c = &inner.counters;
    let mut ok_count = 0;
    for s in &job.statuses {
        let counter = match s {
            BlockStatus::Stored => &c.blocks_stored,
            BlockStatus::AlreadyPresent => &c.blocks_already_present,
            BlockStatus::NotStored => &c.blocks_not_stored,
            BlockStatus::Loaded => &c.blocks_loaded,
            BlockStatus::Missing => &c.blocks_missing,
            BlockStatus::Invalid => &c.blocks_invalid,
            _ => &c.blocks_failed,
        };
        Counters::add(counter, 1);
        ok_count += s.is_ok() as u32;
    }
    let moved = job.statuses.iter().filter(|s| matches!(s, BlockStatus::Stored | BlockStatus::Loaded)).count() as u64 * size;
    Counters::add(if job.op == Opcode::Store { &c.bytes_stored } else { &c.bytes_loaded }, moved);
    let att = &job.att;
    att.inflight.fetch_sub(1, Ordering::AcqRel);
    if !att.is_alive() {
        return;
    }
    let raw: Vec<u8> = job.statuses.iter().map(|s| *s as u8).collect();
    // Checked at submission; the arena cannot shrink (sealed memfd).
    let _ = att.arena.write(job.sqe.status_offset, &raw);
    att.complete(Cqe {
        user_data: job.sqe.user_data,
        result: 0,
        ok_count,
        failed_count: job.statuses.len() as u32 - ok_count,
        ..Cqe::default()
    });
}

/// The peer is gone (or the pool is stopping): nothing is copied, reservations are undone.
pub fn finish_cancelled(inner: &PoolInner, job: Job) {
    let failed: Vec<usize> = job.blocks.iter().map(|b| b.index).collect();
    finish(inner, job, &failed);
}
