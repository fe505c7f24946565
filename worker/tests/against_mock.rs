//! Worker behaviour against the in-process mock pool (tests/common): data path, failure
//! rows of docs/connection.md "Failure rules" that the worker owns, and backpressure.

mod common;

use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use common::{eventually, socket_path, MockPool, REFUSED_NAMESPACE};
use umbp_worker::*;

const PAGE: usize = 256;
const BLOCKS: usize = 16;

/// Two "layers", each `[BLOCKS][PAGE]`, in one buffer of this process.
struct Kv {
    buf: Vec<u8>,
}

impl Kv {
    fn new() -> Self {
        Self { buf: vec![0; 2 * BLOCKS * PAGE] }
    }

    fn spec(&mut self) -> MemorySpec {
        MemorySpec::HostProcess { ptr: self.buf.as_mut_ptr() as usize, len: self.buf.len() }
    }

    fn segments(alloc: u32) -> Vec<Segment> {
        let layer = (BLOCKS * PAGE) as u64;
        vec![
            Segment::new(alloc, 0, PAGE as u64, PAGE as u64, BLOCKS as u64),
            Segment::new(alloc, layer, PAGE as u64, PAGE as u64, BLOCKS as u64),
        ]
    }

    fn block(&self, b: usize) -> Vec<u8> {
        let l = BLOCKS * PAGE;
        [&self.buf[b * PAGE..(b + 1) * PAGE], &self.buf[l + b * PAGE..l + (b + 1) * PAGE]].concat()
    }

    fn fill(&mut self, b: usize, v: u8) {
        let l = BLOCKS * PAGE;
        self.buf[b * PAGE..(b + 1) * PAGE].fill(v);
        self.buf[l + b * PAGE..l + (b + 1) * PAGE].fill(v.wrapping_add(1));
    }
}

fn config(path: &std::path::Path) -> WorkerConfig {
    WorkerConfig { startup_timeout: Duration::from_secs(2), ..WorkerConfig::new(path, 42) }
}

fn attach(path: &std::path::Path, kv: &mut Kv) -> Worker {
    let mut w = Worker::connect(config(path)).unwrap();
    // SAFETY: every test declares its `Kv` before the worker (it outlives it) and reads or
    // fills it only after the transfers touching it completed.
    let a = unsafe { w.register_memory(kv.spec()) }.unwrap();
    assert_eq!(w.register_layout(0, Kv::segments(a)).unwrap(), 2 * PAGE as u64);
    w
}

fn done(w: &mut Worker, id: TransferId) -> Completion {
    w.wait(id, Duration::from_secs(5)).expect("completion in time")
}

#[test]
fn store_then_load_round_trip() {
    let path = socket_path("roundtrip");
    let _pool = MockPool::start(&path);
    let mut kv = Kv::new();
    let mut w = attach(&path, &mut kv);
    kv.fill(3, 0xA0);
    let k = ObjectKey(0x1111);
    let id = w.store(0, &[(k, 3)]).unwrap();
    assert_eq!(done(&mut w, id).statuses, vec![BlockStatus::Stored]);
    let id = w.store(0, &[(k, 4), (ObjectKey(0x2222), 99)]).unwrap();
    assert_eq!(done(&mut w, id).statuses, vec![BlockStatus::AlreadyPresent, BlockStatus::Invalid]);
    let id = w.load(0, &[(k, 7), (ObjectKey(0x3333), 8)]).unwrap();
    let c = done(&mut w, id);
    assert_eq!(c.statuses, vec![BlockStatus::Loaded, BlockStatus::Missing]);
    assert_eq!(kv.block(7), kv.block(3));
    assert_eq!(w.pending(), 0);
    assert!(w.poll().is_empty());
}

#[test]
fn memfd_registration() {
    let path = socket_path("memfd");
    let _pool = MockPool::start(&path);
    let mut w = Worker::connect(config(&path)).unwrap();
    let mfd = memfd::MemfdOptions::new().allow_sealing(true).create("kv").unwrap();
    mfd.as_file().set_len(65536).unwrap();
    mfd.add_seals(&[memfd::FileSeal::SealShrink, memfd::FileSeal::SealGrow]).unwrap();
    let file = mfd.into_file();
    use std::os::unix::fs::FileExt;
    file.write_all_at(&[7u8; 4096], 4096).unwrap();
    let fd: OwnedFd = file.try_clone().unwrap().into();
    let a = w.register_memfd(fd, 0, 65536).unwrap();
    w.register_layout(1, vec![Segment::new(a, 0, 4096, 4096, 16)]).unwrap();
    let id = w.store(1, &[(ObjectKey(5), 1)]).unwrap();
    assert!(done(&mut w, id).all_ok());
    let id = w.load(1, &[(ObjectKey(5), 9)]).unwrap();
    assert!(done(&mut w, id).all_ok());
    let mut back = [0u8; 4096];
    file.read_exact_at(&mut back, 9 * 4096).unwrap();
    assert_eq!(back, [7u8; 4096]);
}

#[test]
fn refusal_is_immediate_and_readable() {
    let path = socket_path("refuse");
    let _pool = MockPool::start(&path);
    let t = Instant::now();
    let err = Worker::connect(WorkerConfig { namespace: REFUSED_NAMESPACE, ..config(&path) }).err().unwrap();
    assert!(t.elapsed() < Duration::from_secs(1), "a refusal is not retried");
    assert!(matches!(&err, WorkerError::Refused { message } if message.contains("0xBAD")), "{err}");
}

#[test]
fn bad_requests_are_refused_locally() {
    let path = socket_path("invalid");
    let _pool = MockPool::start(&path);
    let mut kv = Kv::new();
    let mut w = attach(&path, &mut kv);
    assert!(matches!(w.store(9, &[(ObjectKey(1), 0)]), Err(WorkerError::Invalid(_))));
    assert!(matches!(w.register_layout(2, vec![Segment::new(77, 0, 1, 1, 1)]), Err(WorkerError::Invalid(_))));
    assert!(matches!(w.register_layout(2, vec![]), Err(WorkerError::Invalid(_))));
    // Refused by the pool (extent past the allocation), with its message.
    let err = w.register_layout(2, vec![Segment::new(0, 0, 4096, 4096, 1000)]).unwrap_err();
    assert!(matches!(&err, WorkerError::Refused { message } if message.contains("extent")), "{err}");
    assert!(w.is_connected(), "a refusal keeps the attachment");
    // Empty transfers complete at once.
    let id = w.load(0, &[]).unwrap();
    assert_eq!(w.poll(), vec![Completion { id, statuses: vec![], error: None }]);
}

/// Memory that cannot be exported is refused before anything reaches the pool, with the
/// GPU crate's error kept as the typed source: an unsealed memfd, whose size the pool
/// could not trust.
#[test]
fn unexportable_memory_keeps_the_gpu_error_as_its_source() {
    let path = socket_path("unexportable");
    let _pool = MockPool::start(&path);
    let mut kv = Kv::new();
    let mut w = attach(&path, &mut kv);
    let plain = memfd::MemfdOptions::new().create("unsealed").unwrap();
    plain.as_file().set_len(4096).unwrap();
    let fd: OwnedFd = plain.into_file().into();
    // SAFETY: the memfd is never mapped or written by this test.
    let err = unsafe { w.register_memory(MemorySpec::HostMemfd { fd, offset: 0, len: 4096 }) }.unwrap_err();
    assert!(matches!(&err, WorkerError::Gpu { source: umbp_gpu::GpuError::NotSealed { .. }, .. }), "{err}");
    assert!(std::error::Error::source(&err).is_some_and(|s| s.is::<umbp_gpu::GpuError>()), "{err}");
    assert!(w.is_connected(), "a local refusal keeps the attachment");
}

#[test]
fn wait_keeps_other_completions_for_poll() {
    let path = socket_path("wait");
    let _pool = MockPool::start(&path);
    let mut kv = Kv::new();
    let mut w = attach(&path, &mut kv);
    let a = w.store(0, &[(ObjectKey(1), 1)]).unwrap();
    let b = w.store(0, &[(ObjectKey(2), 2)]).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(done(&mut w, b).id, b);
    assert_eq!(w.pending(), 1);
    let rest = w.poll();
    assert_eq!(rest.len(), 1);
    assert_eq!(rest[0].id, a);
    assert!(w.wait(a, Duration::from_millis(1)).is_none(), "already returned");
}

#[test]
fn stalled_pool_holds_transfers_and_refuses_new_ones() {
    let path = socket_path("stall");
    let pool = MockPool::start(&path);
    let mut kv = Kv::new();
    let mut w = Worker::connect(WorkerConfig { timeout: Duration::from_millis(100), ..config(&path) }).unwrap();
    // SAFETY: `kv` is declared first (outlives `w`); the mock copies only while stalled off.
    let a = unsafe { w.register_memory(kv.spec()) }.unwrap();
    w.register_layout(0, Kv::segments(a)).unwrap();
    pool.stall(true);
    let id = w.store(0, &[(ObjectKey(1), 1)]).unwrap();
    // Not yet overdue: more work is accepted.
    let id2 = w.store(0, &[(ObjectKey(2), 2)]).unwrap();
    assert!(w.wait(id, Duration::from_millis(150)).is_none());
    assert!(matches!(w.store(0, &[(ObjectKey(3), 3)]), Err(WorkerError::Stalled { oldest_ms }) if oldest_ms >= 100));
    assert!(w.poll().is_empty(), "overdue transfers stay pending");
    assert_eq!(w.pending(), 2);
    pool.stall(false);
    assert!(done(&mut w, id).all_ok());
    assert!(done(&mut w, id2).all_ok());
    let id3 = w.store(0, &[(ObjectKey(3), 3)]).unwrap();
    assert!(done(&mut w, id3).all_ok());
}

#[test]
fn full_queues_submit_nothing_and_lose_nothing() {
    let path = socket_path("full");
    let pool = MockPool::start(&path);
    let mut kv = Kv::new();
    let mut w = Worker::connect(WorkerConfig { sq_entries: 4, arena_bytes: 4096, ..config(&path) }).unwrap();
    // SAFETY: `kv` is declared first (outlives `w`) and not touched while transfers run.
    let a = unsafe { w.register_memory(kv.spec()) }.unwrap();
    w.register_layout(0, Kv::segments(a)).unwrap();
    pool.stall(true);
    // SQ of 4: the fifth submission finds it full.
    let mut ids = vec![];
    for i in 0..4 {
        ids.push(w.store(0, &[(ObjectKey(i), 0)]).unwrap());
    }
    assert!(matches!(w.store(0, &[(ObjectKey(9), 0)]), Err(WorkerError::Full)));
    pool.stall(false);
    for id in ids.drain(..) {
        assert!(done(&mut w, id).all_ok());
    }
    // Arena of 4096 bytes holds 163 blocks of 25 bytes: 200 do not fit.
    let many: Vec<(ObjectKey, u64)> = (0..200).map(|i| (ObjectKey(1000 + i), 0)).collect();
    assert!(matches!(w.store(0, &many), Err(WorkerError::Full)));
    let id = w.store(0, &many[..150]).unwrap();
    assert_eq!(done(&mut w, id).statuses.len(), 150);
    assert_eq!(w.pending(), 0);
}

#[test]
fn pool_death_fails_pending_and_restart_reattaches() {
    let path = socket_path("death");
    let pool = MockPool::start(&path);
    let mut kv = Kv::new();
    let mut w = attach(&path, &mut kv);
    kv.fill(2, 0x33);
    pool.stall(true);
    let id = w.store(0, &[(ObjectKey(1), 1), (ObjectKey(2), 2)]).unwrap();
    pool.kill();
    let mut got = vec![];
    eventually(|| {
        got.extend(w.poll());
        !got.is_empty()
    });
    assert_eq!(got, vec![Completion { id, statuses: vec![BlockStatus::Failed; 2], error: None }]);
    assert!(!w.is_connected());
    assert!(matches!(w.store(0, &[(ObjectKey(1), 1)]), Err(WorkerError::Disconnected)));
    // Restarted at the same path: the worker finds it on its own and re-registers.
    let pool = MockPool::start(&path);
    eventually(|| {
        w.poll();
        w.is_connected()
    });
    let id = w.store(0, &[(ObjectKey(2), 2)]).unwrap();
    assert!(done(&mut w, id).all_ok());
    let id = w.load(0, &[(ObjectKey(2), 5)]).unwrap();
    assert!(done(&mut w, id).all_ok());
    assert_eq!(kv.block(5), kv.block(2));
    drop(pool);
}

#[test]
fn reconnect_remaps_pool_chosen_alloc_ids() {
    let path = socket_path("remap");
    let pool = MockPool::start(&path);
    let mut kv = Kv::new();
    let mut w = attach(&path, &mut kv);
    pool.kill();
    eventually(|| {
        w.poll();
        !w.is_connected()
    });
    assert!(w.reconnect_now().is_err(), "nothing listening");
    let pool = MockPool::start(&path);
    // This pool numbers allocations itself (1000+), unlike the one the ids came from.
    pool.shared.own_ids.store(true, std::sync::atomic::Ordering::SeqCst);
    w.reconnect_now().unwrap();
    kv.fill(1, 9);
    let id = w.store(0, &[(ObjectKey(77), 1)]).unwrap();
    let c = done(&mut w, id);
    assert!(c.all_ok(), "{c:?}");
    assert_eq!(w.reset_namespace().unwrap(), 1);
    let id = w.load(0, &[(ObjectKey(77), 2)]).unwrap();
    assert_eq!(done(&mut w, id).statuses, vec![BlockStatus::Missing]);
}

/// `wait` polls the completion ring for `wait_poll`, then sleeps: either way it returns a
/// completion that lands during the wait, and gives up at its timeout, not later, also when
/// the timeout is shorter than the polling or the polling is off.
#[test]
fn wait_polls_then_sleeps_and_keeps_its_timeout() {
    let path = socket_path("waitpoll");
    let pool = MockPool::start(&path);
    for poll in [Duration::ZERO, Duration::from_millis(2), Duration::from_millis(400)] {
        let mut kv = Kv::new();
        let mut w = Worker::connect(WorkerConfig { wait_poll: poll, ..config(&path) }).unwrap();
        // SAFETY: `kv` is declared first (outlives `w`); the mock copies only while not stalled.
        let a = unsafe { w.register_memory(kv.spec()) }.unwrap();
        w.register_layout(0, Kv::segments(a)).unwrap();
        pool.stall(true);
        let id = w.store(0, &[(ObjectKey(10), 1)]).unwrap();
        for timeout in [Duration::from_millis(1), Duration::from_millis(20)] {
            let t = Instant::now();
            assert!(w.wait(id, timeout).is_none(), "wait_poll {poll:?}: stalled transfer completed");
            let took = t.elapsed();
            assert!(
                took >= timeout && took < timeout + Duration::from_millis(200),
                "wait_poll {poll:?}, timeout {timeout:?}: took {took:?}"
            );
        }
        pool.stall(false);
        assert!(w.wait(id, Duration::from_secs(5)).expect("completion after the stall").all_ok(), "wait_poll {poll:?}");
    }
}
