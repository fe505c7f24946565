//! Loom model of the cancel contract (`umbp_protocol::transfer_state`, docs/protocol.md
//! "Cancelling a transfer"): a worker that gives up on a transfer races the pool's
//! copy thread on the transfer's state word; whoever wins decides, and the blocks the
//! worker took back are never read into a published object nor written by the pool.
//!
//! A block of the worker's KV is one atomic word here: the pool's DMA read of it is an
//! Acquire load observed before the pool checks the state (the pool waits for the copy's
//! completion event), and the new owner's write is a Release store made after the worker's
//! abandon (the engine launches its kernels after the connector returned the blocks).
//!
//! Run with `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p umbp-protocol --release --test loom_cancel`.
#![cfg(loom)]

mod common;

use loom::sync::atomic::{AtomicU64, Ordering};
use loom::sync::Arc;
use loom::thread;
use umbp_protocol::transfer_state::{Abandoned, TransferState};

const OLD: u64 = 1;
const NEW: u64 = 2;
const POOLED: u64 = 3;
const NONE: u64 = 0;

/// A transfer's state word and its two blocks (holding the old owner's bytes), with the
/// pool's copy thread running `pool_side` over them.
fn transfer<T: Send + 'static>(
    pool_side: impl FnOnce(&TransferState<'_>, &[AtomicU64; 2]) -> T + Send + 'static,
) -> (Arc<AtomicU64>, Arc<[AtomicU64; 2]>, thread::JoinHandle<T>) {
    let state = Arc::new(AtomicU64::new(0));
    let blocks = Arc::new([AtomicU64::new(OLD), AtomicU64::new(OLD)]);
    let (s2, b2) = (state.clone(), blocks.clone());
    let pool = thread::spawn(move || pool_side(&TransferState::new(&s2), &b2));
    (state, blocks, pool)
}

/// A two-stage store: the pool claims and copies each stage, then publishes it unless
/// the worker abandoned the transfer. The worker abandons at any point and at once lets
/// another request write the blocks. Published bytes are always the old owner's.
#[test]
fn an_abandoned_store_never_publishes_the_new_owners_bytes() {
    let runs = store_model(true);
    assert!(runs >= 10, "the model explored only {runs} executions");
}

/// The mutant docs/protocol.md §4a cites: the same store without the pool's check between
/// a stage's landing and its publication. The model must catch it (an execution where the
/// new owner's bytes are published), or it would catch nothing.
#[test]
#[should_panic(expected = "published")]
fn mutant_without_the_pre_publish_check_is_caught() {
    store_model(false);
}

/// The store race; `check_before_publish: false` is the mutant. Returns the executions
/// explored (panics on a violation).
fn store_model(check_before_publish: bool) -> usize {
    common::loom_model::check(3, move || {
        let (state, blocks, pool) = transfer(move |st, b2| {
            let mut published = [NONE; 2];
            for (stage, slot) in published.iter_mut().enumerate() {
                if !st.begin_stage(stage as u64) {
                    break;
                }
                let copied = b2[stage].load(Ordering::Acquire);
                if !check_before_publish || !st.abandoned() {
                    *slot = copied;
                }
            }
            published
        });
        let st = TransferState::new(&state);
        let outcome = st.abandon();
        assert_ne!(outcome, Abandoned::Already);
        // A store's blocks go back at once, started or not.
        for b in blocks.iter() {
            b.store(NEW, Ordering::Release);
        }
        let published = pool.join().unwrap();
        assert!(published.iter().all(|p| *p == NONE || *p == OLD), "published {published:?}");
        if outcome == Abandoned::BeforeStart {
            assert_eq!(published, [NONE; 2], "nothing of a transfer abandoned before its start");
        }
    })
}

/// A two-stage load: the pool claims each stage and writes its block. The worker abandons;
/// only when nothing was started does it hand the blocks to a new owner, who must find
/// its own bytes there after the pool is done. Stages after the abandon never start.
#[test]
fn a_load_abandoned_before_it_started_never_writes_the_blocks() {
    let runs = common::loom_model::check(3, || {
        let (state, blocks, pool) = transfer(|st, b2| {
            let mut started = 0;
            for stage in 0..2u64 {
                if !st.begin_stage(stage) {
                    break;
                }
                b2[stage as usize].store(POOLED, Ordering::Release);
                started += 1;
            }
            started
        });
        let outcome = TransferState::new(&state).abandon();
        if outcome == Abandoned::BeforeStart {
            for b in blocks.iter() {
                b.store(NEW, Ordering::Release);
            }
        }
        let started = pool.join().unwrap();
        match outcome {
            Abandoned::BeforeStart => {
                assert_eq!(started, 0);
                assert!(blocks.iter().all(|b| b.load(Ordering::Acquire) == NEW), "the pool wrote a block it gave up");
            }
            Abandoned::AfterStages(n) => {
                // The worker held the blocks; exactly the stages it saw started ran.
                assert_eq!(started, n, "a stage started after the abandon");
            }
            Abandoned::Already => panic!("abandoned once"),
        }
    });
    assert!(runs >= 5, "the model explored only {runs} executions");
}
