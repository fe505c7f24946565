//! Per-peer limits against a real `umbp-pool` process (docs/security.md): a peer over a
//! limit gets a refusal or a `Busy` completion that names it, and the pool keeps serving.
//! The fairness half (a flooding worker process vs a well-behaved one) is
//! tests/tests/flood.rs.

mod common;

use std::os::unix::net::UnixStream;

use common::{handshake, memfd_worker, start_pool, unique_socket, PoolProcess, RawPeer};
use umbp_ipc::SharedMemory;
use umbp_protocol::entries::{BlockRef, BusyReason, CqeError, Opcode, Sqe};
use umbp_protocol::layout::Segment;
use umbp_protocol::wire::{Hello, LayoutHeader, MessageKind, Reply, ReplyStatus, Role};
use umbp_protocol::ObjectKey;

fn register(peer: &mut RawPeer, mem: &SharedMemory, alloc_id: u32) -> Reply {
    let reg = umbp_gpu::host::export_memfd(mem.fd(), 0, mem.len() as u64, alloc_id).unwrap();
    peer.control(MessageKind::RegisterMemory, bytemuck::bytes_of(&reg), &[mem.fd()]).0
}

fn layout(peer: &mut RawPeer, group: u32, seg: Segment) -> Reply {
    let mut msg = bytemuck::bytes_of(&LayoutHeader { group, segment_count: 1 }).to_vec();
    msg.extend_from_slice(bytemuck::bytes_of(&seg));
    peer.control(MessageKind::RegisterLayout, &msg, &[]).0
}

#[test]
fn attachments_per_uid() {
    let pool = start_pool(&unique_socket("per-uid"), &["--max-attachments-per-uid", "2"]);
    let a = RawPeer::attach(&pool.socket, Role::Scheduler, 1).unwrap();
    let _b = RawPeer::attach(&pool.socket, Role::Worker, 1).unwrap();
    let e = RawPeer::attach(&pool.socket, Role::Worker, 1).err().unwrap();
    assert!(e.contains("already holds 2 attachments") && e.contains("--max-attachments-per-uid"), "{e}");
    drop(a);
    // The slot comes back once the pool has seen the socket close.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        match RawPeer::attach(&pool.socket, Role::Worker, 1) {
            Ok(_) => break,
            Err(e) => assert!(std::time::Instant::now() < deadline, "slot not freed: {e}"),
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn rings_and_arena_sizes() {
    let pool = start_pool(&unique_socket("arena"), &["--max-arena-bytes", "16MiB", "--max-sq-entries", "2048"]);
    let mut h = Hello::new(Role::Worker, 1, 1);
    h.arena_bytes = 32 << 20;
    let e = handshake(&UnixStream::connect(&pool.socket).unwrap(), &h).unwrap_err();
    assert!(e.contains("arena_bytes 33554432 exceeds this pool's limit of 16777216 (--max-arena-bytes)"), "{e}");
    h.arena_bytes = 16 << 20;
    h.sq_entries = 4096;
    let e = handshake(&UnixStream::connect(&pool.socket).unwrap(), &h).unwrap_err();
    assert!(e.contains("--max-sq-entries"), "{e}");
    h.sq_entries = 2048;
    let (r, _fds) = handshake(&UnixStream::connect(&pool.socket).unwrap(), &h).unwrap();
    assert_eq!((r.arena_bytes, r.sq_entries), (16 << 20, 2048));
}

#[test]
fn registered_bytes_regions_and_layouts() {
    let pool = start_pool(&unique_socket("reg"), &["--max-registered-bytes", "1MiB", "--max-regions", "2", "--max-layouts", "1"]);
    let mut peer = RawPeer::attach(&pool.socket, Role::Worker, 1).unwrap();
    let half = SharedMemory::create("half", 512 << 10, false).unwrap();
    let big = SharedMemory::create("big", 768 << 10, false).unwrap();
    let small = SharedMemory::create("small", 4096, false).unwrap();
    assert_eq!(register(&mut peer, &half, 0).status, 0);
    let r = register(&mut peer, &big, 1);
    assert_eq!(ReplyStatus::from_u32(r.status), ReplyStatus::ResourceExhausted);
    assert!(r.message().contains("--max-registered-bytes"), "{}", r.message());
    assert_eq!(register(&mut peer, &small, 1).status, 0);
    let r = register(&mut peer, &small, 2);
    assert!(r.status != 0 && r.message().contains("--max-regions"), "{}", r.message());
    // Layouts: one group; replacing it is fine, a second group is not.
    assert_eq!(layout(&mut peer, 0, Segment::new(0, 0, 4096, 4096, 8)).status, 0);
    assert_eq!(layout(&mut peer, 0, Segment::new(0, 0, 8192, 8192, 8)).status, 0);
    let r = layout(&mut peer, 1, Segment::new(1, 0, 4096, 4096, 1));
    assert!(r.status != 0 && r.message().contains("--max-layouts"), "{}", r.message());
    // Another peer has its own budget.
    let mut other = RawPeer::attach(&pool.socket, Role::Worker, 1).unwrap();
    assert_eq!(register(&mut other, &half, 0).status, 0);
}

/// `n` submissions of `op` over keys `first_key..+blocks` (block b of each).
fn sqes(peer: &RawPeer, op: Opcode, n: u64, blocks: u64, first_key: u128) -> Vec<Sqe> {
    let a = peer.arena();
    let refs: Vec<BlockRef> = (0..blocks).map(|b| BlockRef::new(ObjectKey(first_key + b as u128), b)).collect();
    a.write(0, &refs).unwrap();
    (0..n)
        .map(|i| Sqe {
            opcode: op as u8,
            count: blocks as u32,
            refs_offset: 0,
            status_offset: (1 << 20) + i * 4096,
            user_data: i,
            ..Sqe::default()
        })
        .collect()
}

/// Stores 16 objects of 1 MiB, then submits `n` loads of all 16 at once (16 MiB each).
fn load_burst(pool: &PoolProcess, n: u64) -> Vec<umbp_protocol::entries::Cqe> {
    let (peer, _mem) = memfd_worker(pool, 1, 1 << 20, 16, 0);
    let c = peer.submit_and_reap(&sqes(&peer, Opcode::Store, 1, 16, 0));
    assert_eq!((c[0].result, c[0].ok_count), (0, 16));
    peer.submit_and_reap(&sqes(&peer, Opcode::Load, n, 16, 0))
}

#[test]
fn inflight_limits_answer_busy_with_the_limit() {
    // Transfers: at most 2 submissions in flight.
    let pool = start_pool(&unique_socket("inflight"), &["--max-inflight", "2"]);
    let c = load_burst(&pool, 32);
    let busy: Vec<_> = c.iter().filter(|c| c.result == -(CqeError::Busy as i32)).collect();
    assert!(!busy.is_empty(), "32 loads of 16 MiB at once with --max-inflight 2 must meet Busy");
    assert!(busy.iter().all(|c| c.busy_reason() == Some(BusyReason::InflightTransfers)), "{busy:?}");
    assert!(c.iter().all(|c| c.result == 0 || c.result == -(CqeError::Busy as i32)));
    assert!(c.iter().filter(|c| c.result == 0).all(|c| c.ok_count == 16), "admitted ones complete in full");
    let r = pool.report();
    assert_eq!(r.counters.busy_refusals, busy.len() as u64);
    drop(pool);

    // Bytes: 16 MiB per submission, at most 24 MiB in flight: the second of a burst waits
    // for the first.
    let pool = start_pool(&unique_socket("inflight-b"), &["--max-inflight-bytes", "24MiB"]);
    let c = load_burst(&pool, 8);
    let busy: Vec<_> = c.iter().filter(|c| c.result == -(CqeError::Busy as i32)).collect();
    assert!(!busy.is_empty(), "8 loads of 16 MiB at once with --max-inflight-bytes 24MiB must meet Busy");
    assert!(busy.iter().all(|c| c.busy_reason() == Some(BusyReason::InflightBytes)), "{busy:?}");
    assert!(c.iter().filter(|c| c.result == 0).all(|c| c.ok_count == 16));
    drop(pool);

    // Alone, a submission over the byte limit is admitted (a limit never starves a peer).
    let pool = start_pool(&unique_socket("inflight-c"), &["--max-inflight-bytes", "1MiB"]);
    let c = load_burst(&pool, 1);
    assert_eq!((c[0].result, c[0].ok_count), (0, 16));
}
