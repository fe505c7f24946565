//! Property tests of the KV event log against a model (the list of every event written):
//! random capacities, bursts of writes, several readers created at different times, polls
//! of random sizes. Each reader must return exactly the model's events from its cursor on,
//! in order, except the ones it is told it lost, which are exactly those the writer lapped.
#![cfg(not(loom))]

mod common;

use common::Region;
use proptest::prelude::*;
use umbp_protocol::events::{region_bytes, EventKind, EventLog, EventLogReader, EventLogWriter};
use umbp_protocol::ObjectKey;

#[derive(Debug, Clone)]
enum Op {
    Write(u64),
    NewReader { oldest: bool },
    Poll { reader: usize, max: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u64..40).prop_map(Op::Write),
        1 => any::<bool>().prop_map(|oldest| Op::NewReader { oldest }),
        4 => (0usize..4, 0usize..50).prop_map(|(reader, max)| Op::Poll { reader, max }),
    ]
}

fn key(n: u64) -> ObjectKey {
    ObjectKey((n as u128) << 64 | n.wrapping_mul(0x9E37_79B9_7F4A_7C15) as u128)
}

fn kind(n: u64) -> EventKind {
    if n.is_multiple_of(3) {
        EventKind::Removed
    } else {
        EventKind::Stored
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    #[test]
    fn readers_match_the_model(cap_log in 1u32..6, ops in proptest::collection::vec(op(), 1..80)) {
        let cap = 1u32 << cap_log;
        let region = Region::new(region_bytes(cap));
        // SAFETY: a zeroed region that outlives every view.
        let log = unsafe { EventLog::init(region.ptr(), region.len(), cap) }.unwrap();
        let mut w = EventLogWriter::new(log);
        let mut written = 0u64;
        // (reader, model cursor)
        let mut readers: Vec<(EventLogReader<'_>, u64)> = vec![(EventLogReader::from_now(log), 0)];
        for op in ops {
            match op {
                Op::Write(n) => {
                    for _ in 0..n {
                        w.push(kind(written), key(written));
                        written += 1;
                    }
                    prop_assert_eq!(log.head(), written);
                }
                Op::NewReader { oldest } => {
                    let start = if oldest { written.saturating_sub(cap as u64) } else { written };
                    let r = if oldest { EventLogReader::from_oldest(log) } else { EventLogReader::from_now(log) };
                    prop_assert_eq!(r.cursor(), start);
                    readers.push((r, start));
                }
                Op::Poll { reader, max } => {
                    let i = reader % readers.len();
                    let (r, cursor) = &mut readers[i];
                    let mut out = Vec::new();
                    let res = r.poll(&mut out, max);
                    // Model: lapped events are lost, then up to `max` in order.
                    let oldest = written.saturating_sub(cap as u64);
                    let lost = if *cursor < written && max > 0 { oldest.saturating_sub(*cursor) } else { 0 };
                    let from = *cursor + lost;
                    let n = (written - from).min(max as u64);
                    prop_assert_eq!(res.lost, lost);
                    prop_assert_eq!(res.read as u64, n);
                    for (j, e) in out.iter().enumerate() {
                        let seq = from + j as u64;
                        prop_assert_eq!(e.seq, seq);
                        prop_assert_eq!(e.key, key(seq));
                        prop_assert_eq!(e.kind, kind(seq));
                    }
                    *cursor = from + n;
                    prop_assert_eq!(r.cursor(), *cursor);
                }
            }
        }
    }
}
