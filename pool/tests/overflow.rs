//! A worker that submits and never reaps its completions (docs/connection.md "Failure rules", a buggy peer): the
//! pool's private completion overflow stays bounded (its SQ is paused once the overflow
//! holds a CQ's worth), the peer is backpressured by its own full SQ, and it recovers,
//! losing no completion, once it reaps. On the old code the overflow grew by one 32 B
//! entry per submission for as long as the peer kept submitting.

mod common;

use std::time::{Duration, Instant};

use common::{start_pool, unique_socket, RawPeer};
use umbp_protocol::entries::{Opcode, Sqe};
use umbp_protocol::wire::Role;

fn nop(user_data: u64) -> Sqe {
    Sqe { opcode: Opcode::Nop as u8, user_data, ..Sqe::default() }
}

/// The attachment of `pid`'s worker in the pool's report.
fn attachment(report: &umbp_pool::PoolReport, id: u32) -> umbp_pool::pool_report::AttachmentReport {
    report.attachment(id).cloned().expect("attachment in the report")
}

#[test]
fn completion_overflow_is_bounded_for_a_peer_that_never_reaps() {
    let pool = start_pool(&unique_socket("overflow"), &[]);
    let peer = RawPeer::attach(&pool.socket, Role::Worker, 1).unwrap();
    let (sq_entries, cq_entries) = (peer.reply.sq_entries as u64, peer.reply.cq_entries as u64);
    let id = peer.reply.attachment_id;
    let total = 8 * cq_entries + 2 * sq_entries;
    let mut sq = peer.sq();
    let mut cq = peer.cq();

    // Submit as fast as the SQ takes them, never reaping, until `total` or until the SQ
    // stays full for a second (the pool stopped reading it).
    let mut pushed = 0u64;
    let mut stalled_since: Option<Instant> = None;
    while pushed < total {
        if sq.try_push(nop(pushed)).unwrap() {
            pushed += 1;
            stalled_since = None;
            continue;
        }
        sq.publish();
        peer.ring_doorbell();
        let since = *stalled_since.get_or_insert_with(Instant::now);
        if since.elapsed() > Duration::from_secs(1) {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    sq.publish();
    peer.ring_doorbell();
    std::thread::sleep(Duration::from_millis(200));
    let a = attachment(&pool.report(), id);
    let overflow = a.cq_overflow as u64;
    // Nops are never in flight: the overflow is at most a CQ's worth plus one batch.
    let bound = cq_entries + 64;
    assert!(overflow <= bound, "completion overflow {overflow} > {bound} for a peer that never reaps (pushed {pushed}): {a}");
    assert!(pushed < total, "the pool kept reading the SQ of a peer that never reaps ({pushed} submissions)");
    assert!(a.sq_paused, "{a}");
    assert_eq!(a.sq_pauses, 1, "{a}");

    // The peer reaps: every submission completes, in order, none lost, and the rest of
    // `total` goes through.
    let mut reaped = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while (reaped.len() as u64) < total {
        assert!(Instant::now() < deadline, "only {} of {total} completions after reaping for 20 s", reaped.len());
        while pushed < total && sq.try_push(nop(pushed)).unwrap() {
            pushed += 1;
        }
        if sq.publish() {
            peer.ring_doorbell();
        }
        cq.wait(100, Some(Duration::from_millis(10))).unwrap();
        let mut batch = Vec::new();
        cq.pop_batch(&mut batch, 1024).unwrap();
        reaped.extend(batch.iter().map(|c| (c.user_data, c.result)));
    }
    assert!(reaped.iter().enumerate().all(|(i, &(u, r))| u == i as u64 && r == 0), "completions out of order or failed");
    let a = attachment(&pool.report(), id);
    assert_eq!((a.cq_overflow, a.sq_paused), (0, false), "{a}");
}
