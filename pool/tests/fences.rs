//! Fence words on every path, and copy threads no peer can hold (docs/gpu.md, fences).
//!
//! A worker's GPU stream waits on a fenced load's word, so the pool must write it however
//! the load ends: loaded, missing, every block id out of range, cancelled, or failed by a
//! panicking copy. Before, only a refused submission wrote it, and the stream waited
//! forever. Host fence pages (a small memfd) behave as on a GPU machine without stream
//! memory operations: the pool writes the word from the CPU, the test reads it.
//!
//! And one peer whose stores wait for a fence its stream never writes occupies at most its
//! share of the copy threads (`--copy-threads-per-peer`): other peers' transfers keep their
//! normal latency (before, two such stores held both copy threads for 30 s each).
//! Several peers of one uid are capped together while the pool serves more than one uid,
//! and the fence wait itself is a pool setting (`store_fence_timeout`).

mod common;
use common::*;

use std::time::{Duration, Instant};

use umbp_ipc::SharedMemory;
use umbp_pool::{Pool, PoolConfig};
use umbp_protocol::entries::{BlockRef, BlockStatus, Cqe, Opcode, Sqe, SQE_CANCELLABLE};
use umbp_protocol::transfer_state::ABANDONED;
use umbp_protocol::wire::MessageKind;
use umbp_protocol::ObjectKey;

const PAGE: u64 = 4096;
const BLOCKS: u64 = 16;
const FENCE_ALLOC: u32 = 1;

fn start(tag: &str, copy_threads: usize) -> (Pool, std::path::PathBuf) {
    let socket = unique_socket(tag);
    let cfg =
        PoolConfig { socket_path: socket.clone(), capacity_bytes: 64 << 20, min_object_bytes: PAGE, copy_threads, ..PoolConfig::default() };
    (Pool::start(cfg).expect("pool starts"), socket)
}

/// A raw worker with KV memory (alloc 0) and a fence page (alloc 1).
fn fenced_worker(socket: &std::path::Path, ns: u128) -> (RawPeer, SharedMemory, SharedMemory) {
    let (mut peer, kv) = memfd_worker_at(socket, ns, PAGE, BLOCKS, 0x5a);
    let fences = SharedMemory::create("fences", 4096, false).unwrap();
    let reg = umbp_gpu::host::export_memfd(fences.fd(), 0, 4096, FENCE_ALLOC).unwrap();
    let (r, _) = peer.control(MessageKind::RegisterMemory, bytemuck::bytes_of(&reg), &[fences.fd()]);
    assert_eq!(r.status, 0, "{}", r.message());
    (peer, kv, fences)
}

fn word(fences: &SharedMemory, slot: u32) -> &std::sync::atomic::AtomicU64 {
    // SAFETY: slot * 8 is inside the 4 KiB page, 8-aligned; accessed only atomically.
    unsafe { &*(fences.as_ptr().add(slot as usize * 8) as *const std::sync::atomic::AtomicU64) }
}

/// A fenced submission of `refs` (at arena offset 64), fence slot `slot`, value `value`.
fn fenced(peer: &RawPeer, op: Opcode, refs: &[BlockRef], slot: u32, value: u64, user_data: u64) -> Sqe {
    peer.arena().write(64, refs).unwrap();
    Sqe {
        opcode: op as u8,
        count: refs.len() as u32,
        user_data,
        refs_offset: 64,
        status_offset: 2048,
        fence_value: value,
        fence_ref: umbp_gpu::fence::encode_ref(FENCE_ALLOC, slot),
        ..Sqe::default()
    }
}

fn statuses(peer: &RawPeer, n: usize) -> Vec<BlockStatus> {
    peer.arena().read::<u8>(2048, n as u64).unwrap().into_iter().map(BlockStatus::from_u8).collect()
}

fn run(peer: &RawPeer, sqe: Sqe) -> Cqe {
    peer.submit_and_reap(&[sqe])[0]
}

#[test]
fn a_fenced_load_gets_its_word_however_it_ends() {
    let (_pool, socket) = start("fence-paths", 2);
    let (peer, _kv, fences) = fenced_worker(&socket, 3);
    let stored = BlockRef::new(ObjectKey(10), 0);
    let c = run(
        &peer,
        Sqe {
            opcode: Opcode::Store as u8,
            count: 1,
            refs_offset: 64,
            status_offset: 2048,
            ..fenced(&peer, Opcode::Store, &[stored], 0, 0, 1)
        },
    );
    assert_eq!((c.result, c.ok_count), (0, 1), "{c:?}");

    // Loaded.
    let c = run(&peer, fenced(&peer, Opcode::Load, &[BlockRef::new(ObjectKey(10), 1)], 1, 11, 11));
    assert_eq!(c.ok_count, 1, "{c:?}");
    assert_eq!(word(&fences, 1).load(std::sync::atomic::Ordering::SeqCst), 11, "loaded");
    // Missing: nothing to copy.
    let c = run(&peer, fenced(&peer, Opcode::Load, &[BlockRef::new(ObjectKey(99), 1)], 2, 12, 12));
    assert_eq!(statuses(&peer, 1), vec![BlockStatus::Missing], "{c:?}");
    assert_eq!(word(&fences, 2).load(std::sync::atomic::Ordering::SeqCst), 12, "missing key");
    // Every block id out of range: the submission never reaches a copy thread.
    let c = run(&peer, fenced(&peer, Opcode::Load, &[BlockRef::new(ObjectKey(10), BLOCKS + 5)], 3, 13, 13));
    assert_eq!(statuses(&peer, 1), vec![BlockStatus::Invalid], "{c:?}");
    assert_eq!(word(&fences, 3).load(std::sync::atomic::Ordering::SeqCst), 13, "ids out of range");
    // Cancelled by the worker before the pool started it.
    peer.arena().atomic_u64(0).unwrap().store(ABANDONED, std::sync::atomic::Ordering::SeqCst);
    let s = Sqe { flags: SQE_CANCELLABLE, state_offset: 0, ..fenced(&peer, Opcode::Load, &[BlockRef::new(ObjectKey(10), 2)], 4, 14, 14) };
    let c = run(&peer, s);
    assert_eq!(c.result, -(umbp_protocol::entries::CqeError::Cancelled as i32), "{c:?}");
    assert_eq!(word(&fences, 4).load(std::sync::atomic::Ordering::SeqCst), 14, "cancelled");
    // A copy thread panicking mid-load.
    umbp_pool::fault::panic_on_copy_of(Some(ObjectKey(10)));
    let c = run(&peer, fenced(&peer, Opcode::Load, &[BlockRef::new(ObjectKey(10), 3)], 5, 15, 15));
    umbp_pool::fault::panic_on_copy_of(None);
    assert_eq!(statuses(&peer, 1), vec![BlockStatus::Failed], "{c:?}");
    assert_eq!(word(&fences, 5).load(std::sync::atomic::Ordering::SeqCst), 15, "copy thread panicked");
}

#[test]
fn a_peer_waiting_on_its_fences_never_holds_every_copy_thread() {
    let (_pool, socket) = start("fence-hog", 2);
    let (hog, _kv, hog_fences) = fenced_worker(&socket, 4);
    let (peer, _kv2) = memfd_worker_at(&socket, 5, PAGE, BLOCKS, 0x11);
    // Two stores whose fences the hog's stream never writes (each would wait 30 s).
    {
        let mut sq = hog.sq();
        for i in 0..2u32 {
            hog.arena().write(64 + i as u64 * 256, &[BlockRef::new(ObjectKey(500 + i as u128), i as u64)]).unwrap();
            let s = Sqe {
                opcode: Opcode::Store as u8,
                count: 1,
                user_data: i as u64,
                refs_offset: 64 + i as u64 * 256,
                status_offset: 2048 + i as u64 * 8,
                fence_value: 7,
                fence_ref: umbp_gpu::fence::encode_ref(FENCE_ALLOC, i),
                ..Sqe::default()
            };
            assert!(sq.try_push(s).unwrap());
        }
        sq.publish();
        hog.ring_doorbell();
    }
    std::thread::sleep(Duration::from_millis(200));
    // The other peer's transfers run at their normal latency meanwhile.
    for round in 0..5u64 {
        let t = Instant::now();
        peer.arena().write(0, &[BlockRef::new(ObjectKey(600 + round as u128), round)]).unwrap();
        let c = peer.submit_and_reap(&[Sqe {
            opcode: Opcode::Store as u8,
            count: 1,
            refs_offset: 0,
            status_offset: 1024,
            user_data: round,
            ..Sqe::default()
        }]);
        assert_eq!(c[0].ok_count, 1, "{c:?}");
        let c = peer.submit_and_reap(&[Sqe {
            opcode: Opcode::Load as u8,
            count: 1,
            refs_offset: 0,
            status_offset: 1024,
            user_data: round,
            ..Sqe::default()
        }]);
        assert_eq!(c[0].ok_count, 1, "{c:?}");
        assert!(t.elapsed() < Duration::from_secs(2), "round {round}: {:?} behind a peer stuck on its fences", t.elapsed());
    }
    // The hog's stores run once their fences are written.
    for i in 0..2 {
        word(&hog_fences, i).store(7, std::sync::atomic::Ordering::SeqCst);
    }
    let mut cq = hog.cq();
    let mut done = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while done.len() < 2 && Instant::now() < deadline {
        cq.wait(100, Some(Duration::from_millis(100))).unwrap();
        cq.pop_batch(&mut done, 8).unwrap();
    }
    assert_eq!(done.len(), 2, "the hog's stores completed once fenced");
    assert!(done.iter().all(|c| c.ok_count == 1), "{done:?}");
}

/// Issue #31 item 6c: a fenced store the worker abandoned (its engine timed out: the
/// fence word will never be written) stops waiting for its fence at once, completes and
/// gives its copy slot back; before, it waited the whole fence timeout (30 s).
#[test]
fn an_abandoned_fenced_store_stops_waiting_for_its_fence() {
    let (_pool, socket) = start("fence-abandoned", 2);
    let (peer, _kv, _fences) = fenced_worker(&socket, 6);
    let arena = peer.arena();
    let state = arena.atomic_u64(0).unwrap();
    state.store(0, std::sync::atomic::Ordering::SeqCst);
    let s = Sqe { flags: SQE_CANCELLABLE, state_offset: 0, ..fenced(&peer, Opcode::Store, &[BlockRef::new(ObjectKey(700), 0)], 0, 9, 70) };
    {
        let mut sq = peer.sq();
        assert!(sq.try_push(s).unwrap());
        sq.publish();
        peer.ring_doorbell();
    }
    // The pool claimed the stage and waits for the fence word.
    let deadline = Instant::now() + Duration::from_secs(5);
    while state.load(std::sync::atomic::Ordering::SeqCst) != 1 {
        assert!(Instant::now() < deadline, "the pool never claimed the stage");
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(50));
    // The worker's cancel.
    let t = Instant::now();
    state.fetch_or(ABANDONED, std::sync::atomic::Ordering::SeqCst);
    let mut cq = peer.cq();
    let mut done = Vec::new();
    while done.is_empty() && t.elapsed() < Duration::from_secs(5) {
        cq.wait(100, Some(Duration::from_millis(100))).unwrap();
        cq.pop_batch(&mut done, 8).unwrap();
    }
    assert_eq!(done.len(), 1, "the abandoned store still waits for its fence after {:?}", t.elapsed());
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    assert_eq!(done[0].ok_count, 0, "{done:?}");
    // Nothing was published.
    peer.arena().write(64, &[BlockRef::new(ObjectKey(700), 1)]).unwrap();
    let c = peer.submit_and_reap(&[Sqe {
        opcode: Opcode::Load as u8,
        count: 1,
        refs_offset: 64,
        status_offset: 2048,
        user_data: 71,
        ..Sqe::default()
    }]);
    assert_eq!(statuses(&peer, 1), vec![BlockStatus::Missing], "{c:?}");
}

/// Issue #32 item 5: the store-fence wait is a pool setting (`store_fence_timeout`,
/// `--store-fence-timeout-ms`). A store whose fence is never written fails after about
/// that time; before, every pool waited the fixed 30 s.
#[test]
fn a_never_written_store_fence_fails_after_the_configured_timeout() {
    let socket = unique_socket("fence-timeout");
    let cfg = PoolConfig {
        socket_path: socket.clone(),
        capacity_bytes: 64 << 20,
        min_object_bytes: PAGE,
        copy_threads: 2,
        store_fence_timeout: Duration::from_millis(300),
        ..PoolConfig::default()
    };
    let _pool = Pool::start(cfg).unwrap();
    let (peer, _kv, _fences) = fenced_worker(&socket, 6);
    let t = Instant::now();
    let c = run(&peer, fenced(&peer, Opcode::Store, &[BlockRef::new(ObjectKey(900), 0)], 0, 7, 1));
    let took = t.elapsed();
    assert_eq!(statuses(&peer, 1), vec![BlockStatus::Failed], "{c:?}");
    assert!(took >= Duration::from_millis(300), "failed before the fence timeout: {took:?}");
    assert!(took < Duration::from_secs(3), "a 300 ms fence timeout answered after {took:?}");
}

#[test]
fn a_zero_store_fence_timeout_is_refused_naming_the_flag() {
    let cfg = PoolConfig { store_fence_timeout: Duration::ZERO, ..PoolConfig::default() };
    let e = cfg.validate().unwrap_err().to_string();
    assert!(e.contains("store-fence-timeout-ms"), "{e}");
}

/// Issue #32 item 5: copy threads are capped per uid while more than one uid is attached.
/// An attacker uid with two attachments, each with a store whose fence it never writes,
/// used to hold both copy threads (each attachment's own share is one) for the whole fence
/// wait: the victim uid's store waited 30 s. Now the attacker's uid holds at most its
/// share (2 threads / 2 uids = 1) and the victim's store runs at once.
#[test]
fn one_uids_many_attachments_waiting_on_fences_never_delay_another_uid() {
    use std::os::unix::fs::PermissionsExt;
    if !umbp_integration_tests::root_or_skip("the attacker runs as uid 65534") {
        return;
    }
    const ATTACKER: u32 = 65534;
    let socket = unique_socket("fence-uid");
    let cfg = PoolConfig {
        socket_path: socket.clone(),
        capacity_bytes: 64 << 20,
        min_object_bytes: PAGE,
        copy_threads: 2,
        allow_uids: vec![ATTACKER],
        ..PoolConfig::default()
    };
    let _pool = Pool::start(cfg).unwrap();
    std::fs::set_permissions(socket.parent().unwrap(), std::fs::Permissions::from_mode(0o777)).unwrap();
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    // The attacker's two attachments connect from a thread running as another uid
    // (credentials are per thread; SO_PEERCRED records the connecting thread's).
    let s = socket.clone();
    let hogs = std::thread::spawn(move || {
        // SAFETY: a raw syscall on this thread's credentials; no memory is passed.
        let rc = unsafe { libc::syscall(libc::SYS_setresuid, ATTACKER as libc::c_long, ATTACKER as libc::c_long, -1 as libc::c_long) };
        assert_eq!(rc, 0, "setresuid: {}", std::io::Error::last_os_error());
        (fenced_worker(&s, 8), fenced_worker(&s, 9))
    })
    .join()
    .unwrap();
    for (i, (hog, _, _)) in [&hogs.0, &hogs.1].into_iter().enumerate() {
        let mut sq = hog.sq();
        hog.arena().write(64, &[BlockRef::new(ObjectKey(700 + i as u128), 0)]).unwrap();
        let s = Sqe {
            opcode: Opcode::Store as u8,
            count: 1,
            user_data: i as u64,
            refs_offset: 64,
            status_offset: 2048,
            fence_value: 7,
            fence_ref: umbp_gpu::fence::encode_ref(FENCE_ALLOC, 0),
            ..Sqe::default()
        };
        assert!(sq.try_push(s).unwrap());
        sq.publish();
        hog.ring_doorbell();
    }
    std::thread::sleep(Duration::from_millis(200));
    // The victim (this process's uid) stores and loads at normal latency.
    let (victim, _kv) = memfd_worker_at(&socket, 10, PAGE, BLOCKS, 0x22);
    let t = Instant::now();
    victim.arena().write(0, &[BlockRef::new(ObjectKey(800), 0)]).unwrap();
    let c = victim.submit_and_reap(&[Sqe {
        opcode: Opcode::Store as u8,
        count: 1,
        refs_offset: 0,
        status_offset: 1024,
        user_data: 1,
        ..Sqe::default()
    }]);
    assert_eq!(c[0].ok_count, 1, "{c:?}");
    // Old code: ~30 s (both copy threads held by the attacker's fence waits).
    assert!(t.elapsed() < Duration::from_secs(1), "the victim's store took {:?} behind another uid's fence waits", t.elapsed());
    // The attacker's stores run once their fences are written.
    for (_, _, fences) in [&hogs.0, &hogs.1] {
        word(fences, 0).store(7, std::sync::atomic::Ordering::SeqCst);
    }
    for (hog, _, _) in [&hogs.0, &hogs.1] {
        let mut cq = hog.cq();
        let mut done = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while done.is_empty() && Instant::now() < deadline {
            cq.wait(1, Some(Duration::from_millis(100))).unwrap();
            cq.pop_batch(&mut done, 8).unwrap();
        }
        assert_eq!(done.len(), 1, "the attacker's store completed once fenced");
        assert_eq!(done[0].ok_count, 1, "{done:?}");
    }
}
