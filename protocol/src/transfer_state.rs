//! The cancel contract of one transfer: a word in the attachment's arena that the worker
//! and the pool race on, so that a worker that gives up on a transfer gets its blocks back
//! without the pool's help, and the pool never touches them afterwards.
//!
//! The word counts the stages the pool has *started* (issued copies for), with
//! [`ABANDONED`] or'ed in by the worker when it gives up:
//!
//! - The pool, before it issues stage `s` (reserves, plans, enqueues its copies), moves
//!   the word from `s` to `s + 1` with one compare-and-swap ([`TransferState::begin_stage`]).
//!   If the CAS fails, the worker abandoned the transfer (or wrote garbage): the pool
//!   issues no further stage.
//! - The pool, after a store stage landed and before it publishes the stage's objects,
//!   reads the word ([`TransferState::abandoned`]); if the worker abandoned the transfer the
//!   objects are dropped, never published: bytes that landed after the worker gave its
//!   blocks back may be another request's KV.
//! - The worker, when it gives up, sets [`ABANDONED`] with one `fetch_or`
//!   ([`TransferState::abandon`]) and learns how many stages the pool had started.
//!   - **Store**: the blocks are the worker's again at once, started or not. The pool only
//!     publishes a stage whose check came before the `fetch_or` (all SeqCst, so before it
//!     in the single total order), and that stage's copies had landed before its check, so
//!     they read the blocks before the worker gave them back.
//!   - **Load, nothing started**: the blocks are the worker's again at once; the pool will
//!     never write them (its next `begin_stage` fails).
//!   - **Load, some stage started**: its copies may still be writing the blocks, so the
//!     worker keeps them until the pool's completion arrives or the pool is known dead
//!     (its process gone: the GPU copies die with its contexts). Later stages never start.
//!
//! Every access to the word is SeqCst: the argument above needs one total order over the
//! pool's checks and the worker's abandon, and the word is touched a few times per
//! transfer. The word's operations alone do not order the *blocks'* bytes, which the
//! copies read and the new owner writes with plain accesses: a SeqCst load is only an
//! acquire, so the copies' earlier reads may still be performed after it (aarch64 does
//! that; x86 does not reorder loads with loads). So the pool's check ([`TransferState::abandoned`])
//! has a SeqCst fence before its load, and the worker's abandon ([`TransferState::abandon`])
//! one after its `fetch_or`: with fence F1 (pool) and F2 (worker) both in the single SeqCst
//! order, a check that reads the word without `ABANDONED` puts F1 before the `fetch_or`,
//! hence before F2, and a read sequenced before F1 can never see a write sequenced after
//! F2 (C++20 [atomics.fences]; `dmb ish` on aarch64, `mfence` or a locked op on x86).
//!
//! A load's claim needs no fence: the CAS is an acquire, so the copies the pool issues
//! after it cannot move before it, and a worker that found the stage unstarted (its
//! `fetch_or` read 0) knows the CAS can only fail.
//!
//! The worker allocates the word with the submission's arena record and frees it only
//! after the pool's completion for that transfer arrived, so a word is never reused while
//! the pool may still CAS on it (an abandoned transfer's completion is dropped unseen).

use crate::sync::{fence, AtomicU64, Ordering};

/// Or'ed into the word by the worker that abandons the transfer.
pub const ABANDONED: u64 = 1 << 63;

/// Bytes of the word in the arena (at the start of a submission's arena record).
pub const STATE_BYTES: u64 = 8;

/// What the worker learnt when it abandoned a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Abandoned {
    /// The pool had started no stage and never will.
    BeforeStart,
    /// The pool had started this many stages (their copies may still run), or had already
    /// seen garbage in the word.
    AfterStages(u64),
    /// It was abandoned before (by an earlier call).
    Already,
}

/// A view of one transfer's state word in shared memory.
#[derive(Clone, Copy)]
pub struct TransferState<'a> {
    word: &'a AtomicU64,
}

impl<'a> TransferState<'a> {
    /// Wraps a word that lives in shared memory.
    pub fn new(word: &'a AtomicU64) -> Self {
        Self { word }
    }

    /// The worker's initial value, written before the submission is published.
    pub fn reset(&self) {
        self.word.store(0, Ordering::SeqCst);
    }

    /// Pool: claims stage `stage` before issuing it. False: the worker abandoned the
    /// transfer (or the word is not what the pool left there): issue nothing more.
    pub fn begin_stage(&self, stage: u64) -> bool {
        self.word.compare_exchange(stage, stage + 1, Ordering::SeqCst, Ordering::SeqCst).is_ok()
    }

    /// Pool: whether the worker gave up on the transfer (checked after a stage landed,
    /// before its objects are published).
    pub fn abandoned(&self) -> bool {
        // SeqCst fence: the copies' reads of the blocks (landed, observed by this thread)
        // are ordered before the load below; paired with the fence in `abandon` (module
        // docs): if this finds no ABANDONED, none of them saw the new owner's bytes.
        fence(Ordering::SeqCst);
        self.word.load(Ordering::SeqCst) & ABANDONED != 0
    }

    /// Worker: gives up on the transfer.
    pub fn abandon(&self) -> Abandoned {
        let prev = self.word.fetch_or(ABANDONED, Ordering::SeqCst);
        // SeqCst fence: whatever the caller (and whoever it hands the blocks to) writes
        // afterwards comes after this in the SeqCst order; paired with the fence in
        // `abandoned` (module docs).
        fence(Ordering::SeqCst);
        match prev {
            0 => Abandoned::BeforeStart,
            p if p & ABANDONED != 0 => Abandoned::Already,
            p => Abandoned::AfterStages(p),
        }
    }

    /// Stages the pool has started (for diagnostics).
    pub fn stages_started(&self) -> u64 {
        self.word.load(Ordering::SeqCst) & !ABANDONED
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn pool_and_worker_race_decides_once() {
        let w = AtomicU64::new(0);
        let s = TransferState::new(&w);
        assert!(s.begin_stage(0));
        assert!(!s.begin_stage(0), "a stage is claimed once");
        assert!(s.begin_stage(1));
        assert_eq!(s.stages_started(), 2);
        assert_eq!(s.abandon(), Abandoned::AfterStages(2));
        assert!(s.abandoned());
        assert!(!s.begin_stage(2), "no stage starts after an abandon");
        assert_eq!(s.abandon(), Abandoned::Already);

        s.reset();
        assert_eq!(s.abandon(), Abandoned::BeforeStart);
        assert!(!s.begin_stage(0), "an abandoned transfer never starts");
    }

    #[test]
    fn garbage_in_the_word_stops_the_pool() {
        let w = AtomicU64::new(12345);
        let s = TransferState::new(&w);
        assert!(!s.begin_stage(0));
    }
}
