//! Loom models of the SPSC ring (docs/protocol.md §1 "SPSC ring"): ordering of entries, slot reuse across
//! wraparound, and the `need_wakeup` sleep/wake protocol.
//!
//! Run with
//! `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p umbp-protocol --release --test loom_ring --test loom_index`.
//!
//! The crate swaps its atomics for loom's under `cfg(loom)` and keeps ring entries in
//! `loom::cell::UnsafeCell`s, so these models check the very code that runs in production
//! and also that no entry is read while it may still be written (or the reverse).
//!
//! Two sleep primitives are modelled, because the pool uses both:
//! * [`Futex`]: what the kernel does for `FUTEX_WAIT`/`FUTEX_WAKE`. The waiter compares the
//!   word with the expected value *under the bucket lock* and only then sleeps; the waker
//!   notifies under the same lock. (A loom `Mutex` + `Condvar`.)
//! * [`Doorbell`]: an eventfd: a counter the waker bumps and the waiter consumes; it has
//!   no compare, so it only works if the `need_wakeup` protocol itself is right. This is the
//!   stricter model: the futex's compare would hide a broken `need_wakeup` protocol.
//!
//! A lost wakeup leaves the consumer blocked forever with the producer finished; loom
//! reports that as a deadlock (a panic), which fails the test.
#![cfg(loom)]

use loom::sync::atomic::{AtomicU32, Ordering};
use loom::sync::{Arc, Condvar, Mutex};
use loom::thread;
use umbp_protocol::ring::{Consumer, LoomRingStorage, Producer, Ring};

/// Kernel futex semantics over one process-wide "hash bucket".
struct Futex {
    bucket: Mutex<()>,
    cv: Condvar,
}

impl Futex {
    fn new() -> Self {
        Self { bucket: Mutex::new(()), cv: Condvar::new() }
    }

    /// FUTEX_WAIT: sleep only if `*word == expected`, checked under the bucket lock. The
    /// load is Relaxed on purpose: the kernel gives no more than "the current value", and
    /// the bucket lock is what orders it against a concurrent FUTEX_WAKE.
    fn wait(&self, word: &AtomicU32, expected: u32) {
        let guard = self.bucket.lock().unwrap();
        if word.load(Ordering::Relaxed) == expected {
            drop(self.cv.wait(guard).unwrap());
        }
    }

    /// FUTEX_WAKE.
    fn wake(&self) {
        let _guard = self.bucket.lock().unwrap();
        self.cv.notify_all();
    }
}

/// eventfd semantics: `ring` adds one, `wait` blocks until the count is non-zero and
/// resets it. No value compare, unlike the futex.
struct Doorbell {
    count: Mutex<u32>,
    cv: Condvar,
}

impl Doorbell {
    fn new() -> Self {
        Self { count: Mutex::new(0), cv: Condvar::new() }
    }

    fn ring(&self) {
        *self.count.lock().unwrap() += 1;
        self.cv.notify_all();
    }

    fn wait(&self) {
        let mut count = self.count.lock().unwrap();
        while *count == 0 {
            count = self.cv.wait(count).unwrap();
        }
        *count = 0;
    }
}

#[derive(Clone, Copy)]
enum Sleep {
    Futex,
    Doorbell,
}

struct Shared {
    ring: LoomRingStorage<u64>,
    futex: Futex,
    doorbell: Doorbell,
}

// SAFETY: the ring's entry cells are only touched through one Producer and one Consumer,
// following the SPSC protocol; loom's cells check exactly that in every execution.
unsafe impl Sync for Shared {}
// SAFETY: as above.
unsafe impl Send for Shared {}

fn shared(capacity: u32) -> Arc<Shared> {
    Arc::new(new_shared(capacity))
}

fn new_shared(capacity: u32) -> Shared {
    Shared { ring: LoomRingStorage::new(capacity), futex: Futex::new(), doorbell: Doorbell::new() }
}

/// For the `should_panic` models: a std `Arc`, whose drop does not call into loom's
/// runtime. Loom's own `Arc` panics again when it is dropped while a deadlock panic
/// unwinds, and a panic during unwinding aborts the whole test binary.
fn shared_std(capacity: u32) -> std::sync::Arc<Shared> {
    std::sync::Arc::new(new_shared(capacity))
}

/// Runs `f` under loom with the given preemption bound (unless `LOOM_MAX_PREEMPTIONS` says
/// otherwise) and returns how many executions were explored. Models assert a minimum: loom's
/// DPOR can silently explore a single interleaving when a model is shaped badly (see
/// loom_index.rs), and a model that explores nothing proves nothing.
fn check(bound: usize, f: impl Fn() + Sync + Send + 'static) -> usize {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(bound);
    }
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let n = runs.clone();
    b.check(move || {
        n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        f()
    });
    let runs = runs.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!("explored {runs} executions");
    runs
}

/// Pushes `batches` (each published with one store), spinning while the ring is full, and
/// wakes the consumer whenever `publish` says it asked for it.
fn produce(p: &mut Producer<'_, u64>, sh: &Shared, batches: &[&[u64]], sleep: Sleep) {
    for batch in batches {
        let mut rest: &[u64] = batch;
        while !rest.is_empty() {
            let (n, wake) = p.push_batch(rest).unwrap();
            if wake {
                match sleep {
                    Sleep::Futex => sh.futex.wake(),
                    Sleep::Doorbell => sh.doorbell.ring(),
                }
            }
            rest = &rest[n..];
            if !rest.is_empty() {
                // Full: wait for the consumer to release slots.
                thread::yield_now();
            }
        }
    }
}

/// Pops until `total` entries arrived, sleeping whenever the ring is empty.
fn consume(c: &mut Consumer<'_, u64>, sh: &Shared, total: usize, max_batch: usize, sleep: Sleep) -> Vec<u64> {
    let mut got = Vec::new();
    while got.len() < total {
        if c.pop_batch(&mut got, max_batch).unwrap() > 0 {
            continue;
        }
        if c.prepare_sleep().unwrap() {
            match sleep {
                Sleep::Futex => sh.futex.wait(c.tail_word(), c.sleep_value()),
                Sleep::Doorbell => sh.doorbell.wait(),
            }
            c.finish_sleep();
        }
    }
    got
}

/// Which side runs on the model's main thread. Loom's DPOR sees different conflicts
/// depending on who runs first, so the doorbell models run both ways.
#[derive(Clone, Copy)]
enum Main {
    Consumer,
    Producer,
}

fn run_sleep_model(capacity: u32, batches: &'static [&'static [u64]], max_batch: usize, sleep: Sleep, main: Main, bound: usize) {
    let runs = check(bound, move || {
        let sh = shared(capacity);
        let total: usize = batches.iter().map(|b| b.len()).sum();
        let want: Vec<u64> = batches.iter().flat_map(|b| b.iter().copied()).collect();
        let sh2 = sh.clone();
        let producer_side = move |sh: &Shared| {
            let mut p = Ring::from_loom(&sh.ring).unwrap().producer();
            produce(&mut p, sh, batches, sleep);
        };
        let consumer_side = move |sh: &Shared| {
            let mut c = Ring::from_loom(&sh.ring).unwrap().consumer();
            let got = consume(&mut c, sh, total, max_batch, sleep);
            assert_eq!(c.available().unwrap(), 0);
            got
        };
        let got = match main {
            Main::Consumer => {
                let t = thread::spawn(move || producer_side(&sh2));
                let got = consumer_side(&sh);
                t.join().unwrap();
                got
            }
            Main::Producer => {
                let t = thread::spawn(move || consumer_side(&sh2));
                producer_side(&sh);
                t.join().unwrap()
            }
        };
        assert_eq!(got, want, "entries lost, duplicated or reordered");
    });
    assert!(runs > 100, "loom explored only {runs} executions");
}

/// Futex sleep, one entry per publish, capacity 2 and three entries: the third reuses slot
/// 0 (wraparound) and the producer may have to wait for a release.
#[test]
fn futex_wakeup_single_entries_wraparound() {
    run_sleep_model(2, &[&[1], &[2], &[3]], 1, Sleep::Futex, Main::Consumer, 3);
}

/// Futex sleep with batched publishes and batched pops across the wrap.
#[test]
fn futex_wakeup_batches_wraparound() {
    run_sleep_model(2, &[&[1, 2], &[3]], 2, Sleep::Futex, Main::Consumer, 3);
}

/// Doorbell (eventfd) sleep: no value compare, so this checks the `need_wakeup` protocol
/// alone (the RMW pairs in `publish` and `prepare_sleep`).
#[test]
fn doorbell_wakeup_single_entries_wraparound() {
    run_sleep_model(2, &[&[1], &[2], &[3]], 1, Sleep::Doorbell, Main::Consumer, 3);
}

#[test]
fn doorbell_wakeup_batches_wraparound() {
    run_sleep_model(2, &[&[1, 2], &[3]], 2, Sleep::Doorbell, Main::Consumer, 3);
}

/// The doorbell model with the producer on the main thread.
#[test]
fn doorbell_wakeup_single_entries_producer_first() {
    run_sleep_model(2, &[&[1], &[2], &[3]], 1, Sleep::Doorbell, Main::Producer, 3);
}

#[test]
fn futex_wakeup_batches_producer_first() {
    run_sleep_model(2, &[&[1, 2], &[3]], 2, Sleep::Futex, Main::Producer, 3);
}

/// Pure polling, capacity 2, four entries (two full laps of the ring), no sleeping: every
/// slot is reused and loom's cell tracking checks the producer never overwrites a slot
/// the consumer has not released.
#[test]
fn polling_no_lost_or_duplicated_entry_two_laps() {
    let runs = check(3, || {
        let sh = shared(2);
        let sh2 = sh.clone();
        let producer = thread::spawn(move || {
            let mut p = Ring::from_loom(&sh2.ring).unwrap().producer();
            for v in 1..=4u64 {
                while !p.try_push(v).unwrap() {
                    thread::yield_now();
                }
                p.publish();
            }
        });
        let mut c = Ring::from_loom(&sh.ring).unwrap().consumer();
        let mut got = Vec::new();
        while got.len() < 4 {
            match c.try_pop().unwrap() {
                Some(v) => {
                    got.push(v);
                    c.release();
                }
                None => thread::yield_now(),
            }
        }
        producer.join().unwrap();
        assert_eq!(got, vec![1, 2, 3, 4]);
    });
    assert!(runs > 100, "loom explored only {runs} executions");
}

/// Sanity check of the harness: a consumer that announces `need_wakeup` *without*
/// re-checking the tail (what `prepare_sleep` does) and then waits on a doorbell loses a
/// wakeup. Loom must find that interleaving and report a deadlock.
#[test]
#[should_panic(expected = "deadlock")]
fn harness_detects_lost_wakeup_without_recheck() {
    check(2, || {
        let sh = shared_std(2);
        let sh2 = sh.clone();
        let producer = thread::spawn(move || {
            let mut p = Ring::from_loom(&sh2.ring).unwrap().producer();
            produce(&mut p, &sh2, &[&[1]], Sleep::Doorbell);
        });
        let mut c = Ring::from_loom(&sh.ring).unwrap().consumer();
        let mut got = Vec::new();
        while got.is_empty() {
            if c.pop_batch(&mut got, 1).unwrap() > 0 {
                break;
            }
            // Broken: flag, then sleep, with no re-check in between.
            c.ring().header().need_wakeup.swap(1, Ordering::AcqRel);
            sh.doorbell.wait();
            c.finish_sleep();
        }
        producer.join().unwrap();
    });
}

/// Sanity check of the harness, futex flavour: a producer that reads `need_wakeup`
/// *before* publishing the tail loses the wakeup even though the futex compares the word.
#[test]
#[should_panic(expected = "deadlock")]
fn harness_detects_lost_wakeup_when_producer_checks_first() {
    check(2, || {
        let sh = shared_std(2);
        let sh2 = sh.clone();
        let producer = thread::spawn(move || {
            let mut p = Ring::from_loom(&sh2.ring).unwrap().producer();
            assert!(p.try_push(1).unwrap());
            // Broken: look at the flag first, publish after.
            let wake = p.ring().header().need_wakeup.load(Ordering::Acquire) != 0;
            p.publish();
            if wake {
                sh2.futex.wake();
            }
        });
        let mut c = Ring::from_loom(&sh.ring).unwrap().consumer();
        let got = consume(&mut c, &sh, 1, 1, Sleep::Futex);
        producer.join().unwrap();
        assert_eq!(got, vec![1]);
    });
}
