//! Property tests of the SPSC ring against a `VecDeque` model: random capacities, batch
//! sizes and interleavings of the producer and consumer calls, counters that start near
//! `u32::MAX` so they wrap during the run, and the sleep handshake interleaved with both.
#![cfg(not(loom))]

mod common;

use std::collections::VecDeque;

use common::Region;
use proptest::prelude::*;
use umbp_protocol::ring::{ring_bytes, Ring, RingHeader};

#[derive(Debug, Clone)]
enum Op {
    /// `push_batch` of this many fresh values.
    PushBatch(usize),
    /// `try_push` of this many fresh values without publishing.
    Write(usize),
    Publish,
    /// `pop_batch` with this maximum.
    PopBatch(usize),
    /// `try_pop` this many times without releasing.
    Read(usize),
    Release,
    /// `prepare_sleep`, then (if it said so) `finish_sleep`, as a consumer that found the
    /// ring empty would.
    SleepCheck,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..40).prop_map(Op::PushBatch),
        2 => (0usize..20).prop_map(Op::Write),
        1 => Just(Op::Publish),
        3 => (0usize..40).prop_map(Op::PopBatch),
        2 => (0usize..20).prop_map(Op::Read),
        1 => Just(Op::Release),
        1 => Just(Op::SleepCheck),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn ring_matches_vecdeque_model(
        cap_log2 in 0u32..6,
        start in prop_oneof![Just(0u32), Just(u32::MAX - 40), any::<u32>()],
        ops in proptest::collection::vec(op(), 1..200),
    ) {
        let capacity = 1u32 << cap_log2;
        let len = ring_bytes::<u64>(capacity);
        let mem = Region::new(len);
        // SAFETY: the region outlives both handles and is only used through them.
        let ring = unsafe { Ring::<u64>::init(mem.ptr(), len, capacity) }.unwrap();
        // Start the free-running counters anywhere, so that they wrap around u32.
        let h: &RingHeader = ring.header();
        h.head.store(start, std::sync::atomic::Ordering::Relaxed);
        h.tail.store(start, std::sync::atomic::Ordering::Relaxed);
        let mut prod = ring.producer();
        // SAFETY: as above.
        let mut cons = unsafe { Ring::<u64>::attach(mem.ptr(), len) }.unwrap().consumer();

        // Model: `published` is what the consumer may see, `written` what the producer
        // wrote but has not published, `taken` what the consumer read but not released.
        let mut published: VecDeque<u64> = VecDeque::new();
        let mut written: VecDeque<u64> = VecDeque::new();
        let mut taken = 0u32;
        let mut next = 1u64;
        let mut expect = 1u64;
        let used = |p: &VecDeque<u64>, w: &VecDeque<u64>, t: u32| p.len() as u32 + w.len() as u32 + t;

        for op in ops {
            match op {
                Op::PushBatch(n) => {
                    let vals: Vec<u64> = (next..next + n as u64).collect();
                    let free = capacity - used(&published, &written, taken);
                    let fits = n.min(free as usize);
                    let (pushed, _wake) = prod.push_batch(&vals).unwrap();
                    prop_assert_eq!(pushed, fits);
                    next += pushed as u64;
                    written.extend(&vals[..pushed]);
                    if pushed > 0 {
                        published.append(&mut written);
                    }
                }
                Op::Write(n) => {
                    for _ in 0..n {
                        let free = capacity - used(&published, &written, taken);
                        let ok = prod.try_push(next).unwrap();
                        prop_assert_eq!(ok, free > 0);
                        if ok {
                            written.push_back(next);
                            next += 1;
                        }
                    }
                }
                Op::Publish => {
                    prod.publish();
                    published.append(&mut written);
                }
                Op::PopBatch(max) => {
                    let mut out = Vec::new();
                    let n = cons.pop_batch(&mut out, max).unwrap();
                    prop_assert_eq!(n, out.len());
                    prop_assert_eq!(n, max.min(published.len()));
                    for v in out {
                        prop_assert_eq!(Some(v), published.pop_front());
                        prop_assert_eq!(v, expect);
                        expect += 1;
                    }
                    if n > 0 {
                        taken = 0;
                    }
                }
                Op::Read(n) => {
                    for _ in 0..n {
                        let got = cons.try_pop().unwrap();
                        prop_assert_eq!(got, published.pop_front());
                        if let Some(v) = got {
                            prop_assert_eq!(v, expect);
                            expect += 1;
                            taken += 1;
                        }
                    }
                }
                Op::Release => {
                    cons.release();
                    taken = 0;
                }
                Op::SleepCheck => {
                    let may_sleep = cons.prepare_sleep().unwrap();
                    // prepare_sleep releases what was consumed.
                    taken = 0;
                    prop_assert_eq!(may_sleep, published.is_empty());
                    if may_sleep {
                        // The futex would compare the tail word with this value.
                        prop_assert_eq!(cons.tail_word().load(std::sync::atomic::Ordering::Acquire), cons.sleep_value());
                        prop_assert!(cons.ring().snapshot().need_wakeup);
                        // A publish now must ask for a wakeup.
                        if prod.try_push(next).unwrap() {
                            written.push_back(next);
                            next += 1;
                            prop_assert!(prod.publish(), "consumer asleep but publish said no wake");
                            published.append(&mut written);
                        }
                        cons.finish_sleep();
                    }
                    prop_assert!(!cons.ring().snapshot().need_wakeup);
                }
            }
            // Invariants after every step.
            let snap = cons.ring().snapshot();
            prop_assert!(snap.len() <= capacity);
            prop_assert_eq!(prod.in_flight() <= capacity, true);
            prop_assert!(used(&published, &written, taken) <= capacity);
        }
        // Drain: exactly the published entries remain, in order.
        let mut out = Vec::new();
        cons.pop_batch(&mut out, usize::MAX).unwrap();
        prop_assert_eq!(out, published.into_iter().collect::<Vec<_>>());
    }
}
