//! docs/connection.md "Failure rules" "malicious or buggy peer": hand-crafted peers send bad handshakes and bad
//! submissions to a real `umbp-pool` process. Each gets a clean refusal or an error CQE,
//! and the pool keeps serving a well-behaved peer throughout.

mod common;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::{handshake, memfd_worker, start_pool, unique_socket, PoolProcess, RawPeer};
use umbp_ipc::SharedMemory;
use umbp_protocol::entries::{BlockRef, BlockStatus, CqeError, Opcode, Sqe, MAX_BLOCKS_PER_SQE};
use umbp_protocol::layout::Segment;
use umbp_protocol::wire::{Hello, LayoutHeader, MessageKind, Role};
use umbp_protocol::ObjectKey;
use umbp_protocol::PROTOCOL_VERSION as PROTOCOL_VERSION_FIELD_CHECK;

const PAGE: u64 = 4096;
const BLOCKS: u64 = 16;

fn sqe(op: Opcode, count: u32, refs_offset: u64, status_offset: u64, user_data: u64) -> Sqe {
    Sqe { opcode: op as u8, count, refs_offset, status_offset, user_data, ..Sqe::default() }
}

/// Stores block `b` of `peer` under `key` and returns the block's status.
fn store_one(peer: &RawPeer, key: ObjectKey, b: u64) -> BlockStatus {
    let a = peer.arena();
    a.write(0, &[BlockRef::new(key, b)]).unwrap();
    let c = peer.submit_and_reap(&[sqe(Opcode::Store, 1, 0, 1024, 77)]);
    assert_eq!(c[0].result, 0);
    BlockStatus::from_u8(a.read::<u8>(1024, 1).unwrap()[0])
}

fn healthy_round_trip(pool: &PoolProcess, salt: u128) {
    let (peer, mem) = memfd_worker(pool, 1, PAGE, BLOCKS, 0);
    // SAFETY: inside the mapping.
    unsafe { std::ptr::write_bytes(mem.as_ptr(), 0x5a ^ salt as u8, PAGE as usize) };
    assert_eq!(store_one(&peer, ObjectKey(1000 + salt), 0), BlockStatus::Stored);
    let a = peer.arena();
    a.write(0, &[BlockRef::new(ObjectKey(1000 + salt), 3)]).unwrap();
    let c = peer.submit_and_reap(&[sqe(Opcode::Load, 1, 0, 1024, 78)]);
    assert_eq!((c[0].result, c[0].ok_count), (0, 1));
    // SAFETY: inside the mapping.
    let page3 = unsafe { std::slice::from_raw_parts(mem.as_ptr().add(3 * PAGE as usize), PAGE as usize) };
    assert!(page3.iter().all(|&b| b == 0x5a ^ salt as u8), "loaded bytes are exact");
}

#[test]
fn bad_handshakes_are_refused_and_the_pool_keeps_serving() {
    let pool = start_pool(&unique_socket("hs"), &[]);

    let mut bad = Hello::new(Role::Worker, 1, 1);
    bad.magic = 0x1234;
    let s = UnixStream::connect(&pool.socket).unwrap();
    assert!(handshake(&s, &bad).unwrap_err().contains("bad magic"));

    let mut old = Hello::new(Role::Worker, 1, 1);
    old.protocol_version = PROTOCOL_VERSION_FIELD_CHECK + 1;
    let s = UnixStream::connect(&pool.socket).unwrap();
    let e = handshake(&s, &old).unwrap_err();
    assert!(e.contains("version mismatch"), "{e}");

    let mut role = Hello::new(Role::Worker, 1, 1);
    role.role = 42;
    let s = UnixStream::connect(&pool.socket).unwrap();
    assert!(handshake(&s, &role).unwrap_err().contains("role"));

    let mut huge = Hello::new(Role::Worker, 1, 1);
    huge.sq_entries = 3;
    let s = UnixStream::connect(&pool.socket).unwrap();
    assert!(handshake(&s, &huge).unwrap_err().contains("ring sizes"));

    // Truncated handshake, then close.
    let mut s = UnixStream::connect(&pool.socket).unwrap();
    s.write_all(&[1, 2, 3]).unwrap();
    drop(s);
    // Connect and say nothing at all (the pool times out on its own thread).
    let silent = UnixStream::connect(&pool.socket).unwrap();
    // Garbage header.
    let mut s = UnixStream::connect(&pool.socket).unwrap();
    s.write_all(&[0xff; 64]).unwrap();

    healthy_round_trip(&pool, 0);
    drop(silent);
    let report = pool.report();
    assert!(report.counters.refusals >= 4, "{report}");
}

#[test]
fn foreign_uid_is_refused_unless_allowed() {
    if !umbp_integration_tests::root_or_skip("to act as another uid") {
        return;
    }
    let pool = start_pool(&unique_socket("uid"), &[]);
    let socket = pool.socket.clone();
    // Let uid 65534 reach the socket file so the refusal comes from SO_PEERCRED.
    std::fs::set_permissions(socket.parent().unwrap(), std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    std::fs::set_permissions(&socket, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let refused = run_as_uid(65534, &socket);
    assert!(refused.contains("uid 65534 is not allowed"), "{refused}");
    drop(pool);

    let pool = start_pool(&unique_socket("uid2"), &["--allow-uid", "65534"]);
    std::fs::set_permissions(pool.socket.parent().unwrap(), std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    std::fs::set_permissions(&pool.socket, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    assert_eq!(run_as_uid(65534, &pool.socket), "attached");
}

/// Connects from a forked child running as `uid`; returns what the handshake said.
fn run_as_uid(uid: u32, socket: &std::path::Path) -> String {
    let (mut r, w) = std::os::unix::net::UnixStream::pair().unwrap();
    // SAFETY: the child only calls async-signal-safe-ish code we control and _exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: in the child.
        unsafe { libc::setuid(uid) };
        let msg = match UnixStream::connect(socket) {
            Ok(s) => match handshake(&s, &Hello::new(Role::Scheduler, 1, std::process::id())) {
                Ok(_) => "attached".to_string(),
                Err(e) => e,
            },
            Err(e) => format!("connect: {e}"),
        };
        let _ = (&w).write_all(msg.as_bytes());
        // SAFETY: leave the forked child without running the parent's destructors.
        unsafe { libc::_exit(0) };
    }
    drop(w);
    let mut out = String::new();
    std::io::Read::read_to_string(&mut r, &mut out).unwrap();
    // SAFETY: reaping our child.
    unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
    out
}

#[test]
fn bad_submissions_get_error_completions() {
    let pool = start_pool(&unique_socket("sqe"), &[]);
    let (peer, _mem) = memfd_worker(&pool, 1, PAGE, BLOCKS, 0);
    let arena_len = peer.layout.arena_bytes as u64;
    let a = peer.arena();
    a.write(0, &[BlockRef::new(ObjectKey(1), 0)]).unwrap();

    let cases = [
        (Sqe { opcode: 99, count: 1, status_offset: 1024, ..Sqe::default() }, CqeError::BadOpcode),
        (sqe(Opcode::Store, 1, arena_len - 8, 1024, 0), CqeError::ArenaOutOfRange),
        (sqe(Opcode::Store, 1, 4, 1024, 0), CqeError::ArenaOutOfRange), // misaligned refs
        (sqe(Opcode::Store, 1, 0, arena_len, 0), CqeError::ArenaOutOfRange),
        (sqe(Opcode::Store, 1, u64::MAX - 7, 0, 0), CqeError::ArenaOutOfRange),
        (sqe(Opcode::Load, MAX_BLOCKS_PER_SQE + 1, 0, 1024, 0), CqeError::TooManyBlocks),
        (sqe(Opcode::Load, 0, 0, 1024, 0), CqeError::TooManyBlocks),
        (Sqe { group: 9, ..sqe(Opcode::Store, 1, 0, 1024, 0) }, CqeError::UnknownGroup),
    ];
    for (i, (mut s, want)) in cases.into_iter().enumerate() {
        s.user_data = i as u64;
        let c = peer.submit_and_reap(&[s]);
        assert_eq!(c[0].user_data, i as u64);
        assert_eq!(c[0].result, -(want as i32), "case {i}: {s:?}");
    }
    // Block ids out of range: per-block Invalid, the valid one is stored.
    a.write(0, &[BlockRef::new(ObjectKey(5), BLOCKS), BlockRef::new(ObjectKey(6), u64::MAX), BlockRef::new(ObjectKey(7), 1)]).unwrap();
    let c = peer.submit_and_reap(&[sqe(Opcode::Store, 3, 0, 1024, 9)]);
    assert_eq!((c[0].result, c[0].ok_count, c[0].failed_count), (0, 1, 2));
    let st: Vec<_> = a.read::<u8>(1024, 3).unwrap().into_iter().map(BlockStatus::from_u8).collect();
    assert_eq!(st, vec![BlockStatus::Invalid, BlockStatus::Invalid, BlockStatus::Stored]);

    // Bad control messages get error replies naming the field, and the peer stays attached.
    let mut peer2 = RawPeer::attach(&pool.socket, Role::Worker, 1).unwrap();
    let mut msg = bytemuck::bytes_of(&LayoutHeader { group: 0, segment_count: 1 }).to_vec();
    msg.extend_from_slice(bytemuck::bytes_of(&Segment::new(7, 0, PAGE, PAGE, 4)));
    let (r, _) = peer2.control(MessageKind::RegisterLayout, &msg, &[]);
    assert!(r.status != 0 && r.message().contains("alloc_id"), "{}", r.message());
    let (r, _) = peer2.control(MessageKind::RegisterLayout, &msg[..12], &[]);
    assert!(r.status != 0 && r.message().contains("truncated"), "{}", r.message());
    let (r, _) = peer2.control(MessageKind::RegisterMemory, &[1, 2, 3], &[]);
    assert!(r.status != 0 && r.message().contains("RegisterMemory"), "{}", r.message());
    // A memfd registration that claims more than the file holds.
    let small = SharedMemory::create("small", 4096, false).unwrap();
    let mut reg = umbp_gpu::host::export_memfd(small.fd(), 0, 4096, 3).unwrap();
    reg.size = 1 << 30;
    let (r, _) = peer2.control(MessageKind::RegisterMemory, bytemuck::bytes_of(&reg), &[small.fd()]);
    assert!(r.status != 0, "oversized memfd region must be refused");

    healthy_round_trip(&pool, 1);
}

#[test]
fn corrupted_ring_detaches_only_that_peer() {
    let pool = start_pool(&unique_socket("ring"), &[]);
    let (peer, _mem) = memfd_worker(&pool, 1, PAGE, BLOCKS, 0);
    // Claim a billion submissions: head + capacity < tail.
    let sq = peer.sq();
    sq.tail_word().store(1_000_000_000, std::sync::atomic::Ordering::Release);
    peer.ring_doorbell();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !umbp_ipc::message::peer_gone(&peer.sock) {
        assert!(std::time::Instant::now() < deadline, "pool did not drop the corrupt peer");
        std::thread::sleep(Duration::from_millis(20));
    }
    healthy_round_trip(&pool, 2);
}

#[test]
fn second_pool_on_a_live_socket_is_refused_and_stale_is_replaced() {
    let socket = unique_socket("live");
    let mut first = start_pool(&socket, &[]);
    let out = std::process::Command::new(umbp_integration_tests::pool_binary())
        .arg("--socket")
        .arg(&socket)
        .args(["--capacity", "16MiB"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("already listening") && err.contains(socket.to_str().unwrap()), "{err}");
    // SIGKILL leaves the socket file behind; the next pool replaces it.
    first.kill();
    assert!(socket.exists());
    let second = start_pool(&socket, &[]);
    healthy_round_trip(&second, 3);
}

#[test]
fn failed_start_names_the_key_and_leaves_no_socket() {
    let socket = unique_socket("badstart");
    for (args, needle) in [
        (&["--capacity", "16MiB", "--numa-node", "999"][..], "numa-node 999"),
        (&["--capacity", "lots"][..], "capacity (UMBP_DRAM_CAPACITY)"),
        (&["--capacity", "16MiB", "--low-wm", "0.95"][..], "low-wm"),
    ] {
        let out =
            std::process::Command::new(umbp_integration_tests::pool_binary()).arg("--socket").arg(&socket).args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} must fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!socket.exists(), "{args:?} left {} behind", socket.display());
    }
}
