//! Stream-ordered transfers (docs/gpu.md "Stream-ordered transfers"): a store that the pool runs only after the
//! engine's stream reached it, and a load the engine's stream waits for on the GPU, with
//! no CPU wait on the engine's hot path. The vLLM connector passes torch's current stream
//! (`torch.cuda.current_stream().cuda_stream`, a raw `CUstream` as an integer).
//!
//! Mechanism ([`umbp_gpu::fence`]): a fence page of [`SLOTS`] 8-byte words in a sealed
//! memfd that this worker maps and registers with CUDA (pinned, device-mapped), and also
//! registers with the pool as `HostMemfd` memory (so it is replayed after a reconnect like
//! any registration). Each fenced transfer uses the slot `seq % SLOTS` with its transfer
//! id as the value:
//!
//! - [`Worker::store_after_stream`] submits the store carrying the slot and value, then
//!   enqueues `cuStreamWriteValue64(slot, id)` on the stream. The pool's copy streams wait
//!   for the word (`cuStreamWaitValue64`) before reading the KV.
//! - [`Worker::load_before_stream`] submits the load, then enqueues
//!   `cuStreamWaitValue64(slot >= id)` on the stream; the pool writes the word once the
//!   bytes landed (also when the load failed or was refused: the completion says which),
//!   so kernels enqueued after the call read loaded KV.
//!
//! A stream waiting for a load must never hang on a dead pool: when the pool's process is
//! known dead (its pidfd; without one, its socket closed), seen by any worker call or by a
//! watchdog thread, every outstanding load word is released (the transfers complete as
//! failed). A lost attachment of a live pool releases only the loads the pool never
//! started; a started one's stream waits for its completion or the pool's death, as its
//! blocks do (docs/connection.md "A lost pool"). A stalled but live pool keeps the stream
//! waiting, as it keeps a CPU waiter waiting (docs/gpu.md).
//!
//! Slots are reused only after their previous transfer's completion was reaped (the pool
//! wrote or waited for the word before completing it), so a word only ever grows.

use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use std::os::fd::{AsFd, OwnedFd};
use umbp_gpu::cuda::HostWords;
use umbp_gpu::fence::{self as gf, FenceWord, SLOT_BYTES};

use umbp_ipc::message::peer_gone;
use umbp_ipc::peer::pidfd_exited;
use umbp_ipc::SharedMemory;

use crate::WorkerError;

/// Fence words per worker: more than any ring holds in flight.
pub(crate) const SLOTS: u32 = 16384;

/// How often the watchdog checks the pool's socket while loads are outstanding.
const WATCH_PERIOD: Duration = Duration::from_millis(2);

struct Watch {
    /// Outstanding fenced loads: (slot, value).
    loads: Vec<(u32, u64)>,
    /// The attachment whose socket is watched, a dup of it, and a dup of the pool's pidfd
    /// (None: its pid is not visible here).
    sock: Option<(u32, UnixStream, Option<OwnedFd>)>,
    stop: bool,
}

struct Page {
    /// CUDA registration of the mapping; dropped before `mem` (field order).
    gpu: HostWords,
    mem: SharedMemory,
    watch: Mutex<Watch>,
    wake: Condvar,
}

// SAFETY: the mapping is plain shared memory accessed only through atomics (FenceWord);
// HostWords and SharedMemory are handles; the watch state is behind a mutex.
unsafe impl Send for Page {}
// SAFETY: as above.
unsafe impl Sync for Page {}

impl Page {
    fn word(&self, slot: u32) -> FenceWord<'_> {
        debug_assert!(slot < SLOTS);
        // SAFETY: slot < SLOTS words lie inside the page-aligned mapping of SLOTS * 8
        // bytes, which lives as long as `self`; only accessed atomically.
        unsafe {
            FenceWord::new(
                self.mem.as_ptr().add(slot as usize * SLOT_BYTES as usize).cast(),
                Some(self.gpu.device() + slot as u64 * SLOT_BYTES),
            )
        }
    }

    fn watch(&self) -> MutexGuard<'_, Watch> {
        self.watch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Releases every outstanding load wait (raising each word to its value, never
    /// lowering a word a newer transfer already raised).
    fn release_loads(&self, w: &mut Watch) {
        for (slot, value) in w.loads.drain(..) {
            self.word(slot).signal(value);
        }
    }
}

/// The fence state of one [`Worker`].
pub(crate) struct Fences {
    page: Arc<Page>,
    /// Caller-visible alloc id of the fence page registration.
    alloc_id: u32,
    next_seq: u64,
    /// Transfer id that last used each slot (0: none).
    owner: Vec<u64>,
    /// Slots whose word carries an abort mark (reset before reuse).
    poisoned: Vec<bool>,
    /// Any fenced transfer was made: streams may still hold operations on the page.
    used: bool,
    watchdog: Option<JoinHandle<()>>,
}

impl Fences {
    /// Releases the GPU wait of load `id`, cancelled before the pool started it (the pool
    /// never writes its word then). The completion says the blocks did not load.
    pub(crate) fn release_load(&self, id: u64) {
        let mut w = self.page.watch();
        if let Some(i) = w.loads.iter().position(|&(_, v)| v == id) {
            let (slot, value) = w.loads.swap_remove(i);
            self.page.word(slot).signal(value);
        }
    }
}

impl Drop for Fences {
    fn drop(&mut self) {
        {
            let mut w = self.page.watch();
            self.page.release_loads(&mut w);
            w.stop = true;
        }
        self.page.wake.notify_all();
        if let Some(t) = self.watchdog.take() {
            let _ = t.join();
        }
        if self.used {
            // A stream may still hold a write or wait on the page (the engine's stream
            // runs behind the CPU). Unregistering or unmapping it now could fault the
            // GPU; 128 KiB stays pinned until the process exits instead.
            std::mem::forget(self.page.clone());
        }
    }
}

fn watchdog(page: Arc<Page>) {
    let mut w = page.watch();
    loop {
        if w.stop {
            return;
        }
        if w.loads.is_empty() {
            w = page.wake.wait(w).unwrap_or_else(|e| e.into_inner());
            continue;
        }
        // Only the pool's death ends its copies: a closed socket of a live pool process (it
        // hung up on this attachment) may still have copies landing in the blocks. Without
        // a pidfd (the pool in another pid namespace) the closed socket is all there is.
        let dead = |s: &UnixStream, pidfd: &Option<OwnedFd>| peer_gone(s) && pidfd.as_ref().is_none_or(|p| pidfd_exited(p.as_fd()));
        if w.sock.as_ref().is_some_and(|(_, s, p)| dead(s, p)) {
            tracing::warn!(loads = w.loads.len(), "UMBP pool gone: releasing GPU streams waiting for loads");
            page.release_loads(&mut w);
            continue;
        }
        w = page.wake.wait_timeout(w, WATCH_PERIOD).unwrap_or_else(|e| e.into_inner()).0;
    }
}

pub(crate) fn gpu_err(what: &str, source: umbp_gpu::GpuError) -> WorkerError {
    WorkerError::Gpu { what: what.to_string(), source }
}

impl Fences {
    /// Maps a fence page, registers it with CUDA (pinned, device-mapped; `stream` is the
    /// caller's live stream or 0) and, through `register` (its memfd and length; returns
    /// the caller-visible alloc id), with the pool; starts the watchdog.
    pub(crate) fn create(stream: u64, register: impl FnOnce(OwnedFd, u64) -> Result<u32, WorkerError>) -> Result<Fences, WorkerError> {
        let len = SLOTS as usize * SLOT_BYTES as usize;
        let mem = SharedMemory::create("umbp-fences", len, false).map_err(|source| WorkerError::Shm { what: "fence page", source })?;
        // SAFETY: the mapping lives in `Page` next to the registration, which is dropped
        // first; `stream` is the caller's live stream (or 0).
        let gpu = unsafe { HostWords::register(mem.as_ptr(), len, stream as umbp_gpu::cuda::sys::CUstream) }
            .map_err(|e| gpu_err("stream-ordered transfers need CUDA in this process", e))?;
        let fd = mem.fd().try_clone_to_owned().map_err(WorkerError::Io)?;
        let alloc_id = register(fd, len as u64)?;
        let page =
            Arc::new(Page { gpu, mem, watch: Mutex::new(Watch { loads: Vec::new(), sock: None, stop: false }), wake: Condvar::new() });
        let p2 = page.clone();
        let watchdog = std::thread::Builder::new().name("umbp-fence-watch".into()).spawn(move || watchdog(p2)).map_err(WorkerError::Io)?;
        tracing::debug!(alloc_id, slots = SLOTS, "UMBP fence page ready");
        Ok(Fences {
            page,
            alloc_id,
            next_seq: 0,
            owner: vec![0; SLOTS as usize],
            poisoned: vec![false; SLOTS as usize],
            used: false,
            watchdog: Some(watchdog),
        })
    }

    /// (alloc id, slot) for the next fenced transfer, or `Full` while that slot's last
    /// transfer is still in flight. Watched loads that are no longer in flight are
    /// forgotten first.
    pub(crate) fn next_slot(&mut self, in_flight: impl Fn(u64) -> bool) -> Result<(u32, u32), WorkerError> {
        self.page.watch().loads.retain(|&(_, id)| in_flight(id));
        let slot = (self.next_seq % SLOTS as u64) as u32;
        let owner = self.owner[slot as usize];
        if owner != 0 && in_flight(owner) {
            return Err(WorkerError::Full);
        }
        if self.poisoned[slot as usize] {
            // Its store was aborted and completed; nothing else touches the word now.
            self.page.word(slot).store(0);
            self.poisoned[slot as usize] = false;
        }
        Ok((self.alloc_id, slot))
    }

    /// Makes the pool's read of store `id` wait for `stream`: enqueues the stream's write of
    /// `id` into the slot's word. If it cannot be enqueued, the store is aborted (the pool
    /// sees the abort mark and fails it) and the error returned.
    pub(crate) fn order_store(&mut self, slot: u32, id: u64, stream: u64) -> Result<(), WorkerError> {
        let word = self.page.word(slot);
        let addr = word.device().expect("fence pages are device-mapped");
        // SAFETY: `addr` is a word of the registered fence page, which is never
        // unregistered once a fenced transfer was made (Fences::drop).
        if let Err(e) = unsafe { umbp_gpu::cuda::fence_write(stream, addr, id) } {
            // The pool must not read KV the stream may still be writing: abort the store.
            word.signal(id.wrapping_add(gf::ABORT));
            self.poisoned[slot as usize] = true;
            return Err(gpu_err(&format!("store {id} aborted (it completes as failed): cuStreamWriteValue64 on stream {stream:#x}"), e));
        }
        Ok(())
    }

    /// Makes `stream` wait for load `id`'s word, watched (with the attachment `sock`: id,
    /// socket, the pool's pidfd) so that a dead pool releases it.
    pub(crate) fn order_load(
        &mut self,
        slot: u32,
        id: u64,
        stream: u64,
        sock: Option<(u32, UnixStream, Option<OwnedFd>)>,
    ) -> Result<(), WorkerError> {
        {
            let mut w = self.page.watch();
            if let Some((att, s, p)) = sock {
                if w.sock.as_ref().is_none_or(|(a, _, _)| *a != att) {
                    w.sock = Some((att, s, p));
                }
            }
            w.loads.push((slot, id));
        }
        self.page.wake.notify_all();
        let addr = self.page.word(slot).device().expect("fence pages are device-mapped");
        // SAFETY: a word of the registered fence page, never unregistered once used.
        unsafe { umbp_gpu::cuda::fence_wait(stream, addr, id) }.map_err(|e| {
            gpu_err(
                &format!("load {id} runs but the stream does not wait for it; wait for its completion on the CPU: cuStreamWaitValue64 on stream {stream:#x}"),
                e,
            )
        })
    }

    /// Slot `slot` now belongs to transfer `id`.
    pub(crate) fn claim(&mut self, slot: u32, id: u64) {
        self.owner[slot as usize] = id;
        self.next_seq += 1;
        self.used = true;
    }
}
