//! Registering (pinning) the DRAM tier with every GPU driver present, so copies to and from
//! GPUs run as DMA from pinned memory. The first 256 MiB is registered before the pool
//! listens (it can take stores at once); the rest on background threads, since pinning
//! hundreds of GiB takes minutes. Meanwhile the allocator hands out only the registered
//! prefix (`page_limit`), a worker's own GPU registration goes first (`ForegroundGate`),
//! and progress is logged and reported (`dram_registered_bytes`).
//!
//! What pins is a `DramPinner`: the GPU drivers in production (`gpu_pinners`); the pool
//! takes them as an argument (`Pool::start_with_pinners`), so a test on a GPU-less machine
//! can run the whole background pass against a slow stand-in and watch workers meanwhile.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use umbp_protocol::wire::MemoryKind;

use super::Store;

/// What the registration threads use of the pool: the store (its DRAM, and the object
/// store whose page limit follows the registered prefix) and the pool's stop flag.
#[derive(Clone)]
pub(crate) struct Registrar {
    pub store: Arc<Store>,
    pub stopping: Arc<AtomicBool>,
}

impl Registrar {
    fn is_shutting_down(&self) -> bool {
        // Acquire pairs with `Pool::stop`'s AcqRel swap: a thread that sees the flag sees
        // what was written before the stop began.
        self.stopping.load(Ordering::Acquire)
    }
}

/// Pins (page-locks and maps for DMA) a range of the pool's DRAM, and releases it.
pub trait DramPinner: Send + Sync {
    /// For logs: which driver this is.
    fn name(&self) -> String;

    /// Pins `[base, base + len)`.
    ///
    /// # Safety
    /// The range is mapped and stays mapped until `unpin(base)` returns.
    unsafe fn pin(&self, base: *mut u8, len: usize) -> Result<(), String>;

    /// Releases the range pinned at `base`.
    ///
    /// # Safety
    /// `base` was pinned by this pinner and no copy uses the range any more.
    unsafe fn unpin(&self, base: *mut u8) -> Result<(), String>;
}

/// A GPU driver's host-memory registration (`cuMemHostRegister`, `hipHostRegister`).
pub struct GpuPinner(Arc<dyn umbp_gpu::Backend>);

impl DramPinner for GpuPinner {
    fn name(&self) -> String {
        format!("{:?}", self.0.kind())
    }

    unsafe fn pin(&self, base: *mut u8, len: usize) -> Result<(), String> {
        // SAFETY: the caller keeps the range mapped until `unpin` (this fn's contract).
        unsafe { self.0.register_host_memory(base, len) }.map_err(|e| e.to_string())
    }

    unsafe fn unpin(&self, base: *mut u8) -> Result<(), String> {
        // SAFETY: pinned by `pin` of this driver and no longer used (this fn's contract).
        unsafe { self.0.unregister_host_memory(base) }.map_err(|e| e.to_string())
    }
}

/// The GPU drivers present that see a device: what a production pool pins with. A
/// driver whose library loads but sees no device (a CUDA driver on a GPU-less machine)
/// cannot register anything, so it is left out instead of failing every chunk.
pub fn gpu_pinners() -> Vec<Arc<dyn DramPinner>> {
    [MemoryKind::Cuda, MemoryKind::Hip]
        .into_iter()
        .filter(|k| match k {
            MemoryKind::Cuda => umbp_gpu::cuda::device_count().is_ok_and(|n| n > 0),
            _ => umbp_gpu::hip::device_count().is_ok_and(|n| n > 0),
        })
        .filter_map(|k| umbp_gpu::backend_for(k).ok())
        .map(|b| Arc::new(GpuPinner(b)) as Arc<dyn DramPinner>)
        .collect()
}

/// What to unpin at stop: each pinner with the base of every chunk it pinned.
pub type Registrations = Vec<(Arc<dyn DramPinner>, usize)>;

/// Registered before the pool listens.
const FIRST_CHUNK: usize = 256 << 20;
/// One background step: a multiple of the 2 MiB slab page (no slab object straddles two
/// registrations), small enough that foreground work waits at most one step (~80 ms at the
/// 1.6 GiB/s the driver pins on an H100 host).
const CHUNK: usize = 128 << 20;
/// Threads faulting DRAM in ahead of the registration. Registration itself runs on one
/// thread: measured on the H200 host (2026-12-05), four threads pinned 64 GiB at 1.74 GiB/s
/// against 1.61 GiB/s for one (H100 host), since the driver serializes it, and every
/// thread mid-chunk is one more chunk a worker's registration waits for.
const POPULATE_THREADS: usize = 4;
/// After a worker's GPU registration, the background waits this long for the next one of
/// the same burst before it pins again.
const QUIET: Duration = Duration::from_millis(250);
/// How long one chunk waits for foreground work to end before it goes anyway, so a
/// stream of registrations cannot keep the pool from ever registering its DRAM.
const MAX_YIELD: Duration = Duration::from_secs(10);
/// Progress lines at most this often (a 512 GiB pool has 2,048 chunks).
const PROGRESS_EVERY: Duration = Duration::from_secs(2);

/// Starts the registration with `backends`: the first chunk now, the rest on background
/// threads. Returns the thread that joins them (its result: what to unpin at stop), or
/// None when there is nothing to pin with (host backends only) or the thread could not
/// start.
pub fn register_dram(reg: &Registrar, backends: Vec<Arc<dyn DramPinner>>) -> Option<std::thread::JoinHandle<Registrations>> {
    if backends.is_empty() {
        tracing::debug!("no GPU driver found: DRAM stays unregistered (host backends only)");
        reg.store.dram.set_registration_done();
        return None;
    }
    reg.store.objects.lock().expect("store lock").set_page_limit(0);
    let len = reg.store.dram.len();
    tracing::info!(
        total_bytes = len,
        backends = backends.len(),
        populate_threads = POPULATE_THREADS,
        "registering DRAM with the GPU driver (the first {} MiB now, the rest in the background)",
        FIRST_CHUNK >> 20
    );
    let first = FIRST_CHUNK.min(len);
    let progress = Progress::new(len);
    let mut done = Registrations::new();
    reg.store.dram.populate(0, first);
    register_range(reg, &backends, 0, first, &mut done);
    progress.finished(reg, 0, first);
    let outer = reg.clone();
    let reg = reg.clone();
    let t = std::thread::Builder::new().name("umbp-register".into()).spawn(move || {
        let mut mine = Registrations::new();
        pin_in_background(&reg, first, len, CHUNK, &progress, |off, n| register_range(&reg, &backends, off, n, &mut mine));
        done.extend(mine);
        if reg.is_shutting_down() && progress.prefix() < len {
            tracing::info!(bytes = progress.prefix(), total_bytes = len, "DRAM registration stopped: the pool is stopping");
            return done;
        }
        reg.store.objects.lock().expect("store lock").set_page_limit(u32::MAX);
        reg.store.dram.set_registration_done();
        tracing::info!(
            bytes = progress.prefix(),
            elapsed_s = progress.started.elapsed().as_secs_f64(),
            gib_per_s = progress.rate(),
            "DRAM registration done"
        );
        done
    });
    match t {
        Ok(t) => Some(t),
        Err(e) => {
            // Serve unregistered (staged copies) rather than never hand out a page. The
            // first chunk stays registered until the process exits.
            tracing::warn!("cannot start the DRAM registration thread: {e}; DRAM past the first chunk stays unregistered");
            outer.store.objects.lock().expect("store lock").set_page_limit(u32::MAX);
            outer.store.dram.set_registration_done();
            None
        }
    }
}

/// Registers `[first, len)` in `chunk`s, in order, with `register`: populate threads fault
/// each chunk in ahead of the one registering thread, so the driver only pins pages
/// already there, and its lock (which every GPU call of every process on the node waits
/// for) is held for a fraction of the time. Stops early when the pool shuts down.
fn pin_in_background(reg: &Registrar, first: usize, len: usize, chunk: usize, progress: &Progress, mut register: impl FnMut(usize, usize)) {
    let chunks = (len - first).div_ceil(chunk);
    let range = |i: usize| (first + i * chunk, chunk.min(len - first - i * chunk));
    let next_populate = AtomicUsize::new(0);
    let populated: Vec<AtomicBool> = (0..chunks).map(|_| AtomicBool::new(false)).collect();
    std::thread::scope(|scope| {
        for _ in 0..POPULATE_THREADS {
            let (next_populate, populated) = (&next_populate, &populated);
            scope.spawn(move || loop {
                let i = next_populate.fetch_add(1, Ordering::Relaxed);
                if i >= chunks || reg.is_shutting_down() {
                    return;
                }
                let (off, n) = range(i);
                // Beyond the registered prefix: the allocator hands out none of it yet.
                reg.store.dram.populate(off, n);
                // Release: pairs with the registering thread's Acquire (the pages are in).
                populated[i].store(true, Ordering::Release);
            });
        }
        for (i, ready) in populated.iter().enumerate() {
            while !ready.load(Ordering::Acquire) && !reg.is_shutting_down() {
                std::thread::sleep(Duration::from_millis(1));
            }
            yield_to_foreground(reg);
            if reg.is_shutting_down() {
                break;
            }
            let (off, n) = range(i);
            register(off, n);
            progress.finished(reg, off, n);
        }
    });
}

/// Waits (bounded) while a worker's GPU registration is in progress.
fn yield_to_foreground(reg: &Registrar) {
    let until = Instant::now() + MAX_YIELD;
    while reg.store.dram.gate.busy(QUIET) && Instant::now() < until && !reg.is_shutting_down() {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Registers `[off, off + n)` of DRAM with every backend.
fn register_range(reg: &Registrar, backends: &[Arc<dyn DramPinner>], off: usize, n: usize, done: &mut Registrations) {
    let base = reg.store.dram.base() as usize;
    for b in backends {
        // SAFETY: a chunk of the DRAM mapping, which outlives the pool's threads;
        // unpinned in `Pool::stop` after every copy thread has exited.
        match unsafe { b.pin((base + off) as *mut u8, n) } {
            Ok(()) => done.push((b.clone(), base + off)),
            Err(e) => tracing::warn!(offset = off, "registering DRAM with {} failed: {e}; copies there will be staged", b.name()),
        }
    }
}

/// The registered prefix the allocator may use, and the progress log. Chunks are accepted
/// in any order (the prefix grows only over adjoining ones), so the order of registration
/// can change without the allocator ever handing out an unregistered page.
struct Progress {
    started: Instant,
    total: usize,
    state: Mutex<ProgressState>,
}

struct ProgressState {
    /// Registered `[0, prefix)`.
    prefix: usize,
    /// Offsets of chunks done beyond the prefix, with their lengths.
    ahead: BTreeSet<(usize, usize)>,
    logged: Instant,
}

impl Progress {
    fn new(total: usize) -> Self {
        let now = Instant::now();
        Self { started: now, total, state: Mutex::new(ProgressState { prefix: 0, ahead: BTreeSet::new(), logged: now }) }
    }

    fn prefix(&self) -> usize {
        self.state.lock().expect("progress lock").prefix
    }

    fn rate(&self) -> f64 {
        self.prefix() as f64 / (1u64 << 30) as f64 / self.started.elapsed().as_secs_f64().max(1e-9)
    }

    /// `[off, off + n)` is registered: extends the prefix over every chunk now adjoining
    /// it and lets the allocator hand out pages up to its end.
    fn finished(&self, reg: &Registrar, off: usize, n: usize) {
        self.advance(off, n, |prefix| {
            reg.store.objects.lock().expect("store lock").set_page_limit((prefix as u64 / crate::config::PAGE_BYTES) as u32);
            reg.store.dram.set_registered(prefix as u64);
        });
    }

    /// Records `[off, off + n)` as done; when the registered prefix grew, calls `grew` with
    /// its new end under the progress lock (so what it sets only ever grows).
    fn advance(&self, off: usize, n: usize, grew: impl FnOnce(usize)) {
        let mut st = self.state.lock().expect("progress lock");
        st.ahead.insert((off, n));
        let before = st.prefix;
        while let Some(&(o, len)) = st.ahead.first() {
            if o != st.prefix {
                break;
            }
            st.ahead.pop_first();
            st.prefix = o + len;
        }
        if st.prefix == before {
            return;
        }
        let prefix = st.prefix;
        grew(prefix);
        if st.logged.elapsed() >= PROGRESS_EVERY || prefix == self.total || before == 0 {
            st.logged = Instant::now();
            let secs = self.started.elapsed().as_secs_f64();
            tracing::info!(
                registered_bytes = prefix,
                total_bytes = self.total,
                elapsed_s = secs,
                gib_per_s = prefix as f64 / (1u64 << 30) as f64 / secs.max(1e-9),
                "DRAM registration progress"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chunks finishing out of order on several threads: the allocator's limit follows the
    /// contiguous registered prefix only, and only grows.
    #[test]
    fn the_registered_prefix_grows_only_over_adjoining_chunks() {
        let p = Progress::new(5 * CHUNK);
        let mut seen = Vec::new();
        for i in [0usize, 2, 3, 1, 4] {
            p.advance(i * CHUNK, CHUNK, |end| seen.push(end));
        }
        assert_eq!(seen, vec![CHUNK, 4 * CHUNK, 5 * CHUNK]);
        assert_eq!(p.prefix(), 5 * CHUNK);
    }

    /// The background pass with a recording registrar on a real (GPU-less) pool: chunks go
    /// in order and cover the range, the allocator's limit follows them, and a worker's
    /// registration (the gate held) pauses the pass until it ends and the quiet period
    /// passes.
    #[test]
    fn the_background_pass_registers_in_order_and_steps_aside_for_a_registration() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = crate::PoolConfig { socket_path: dir.path().join("s"), capacity_bytes: 64 << 20, ..crate::PoolConfig::default() };
        let pool = crate::Pool::start(cfg).expect("pool starts");
        let access = pool.cluster_access();
        let reg = Registrar { store: access.store.clone(), stopping: Arc::new(AtomicBool::new(false)) };
        let (first, len, chunk) = (4 << 20, 64 << 20, 4 << 20);
        reg.store.objects.lock().unwrap().set_page_limit((first as u64 / crate::PAGE_BYTES) as u32);
        let progress = Progress::new(len);
        progress.advance(0, first, |_| {});
        let held = reg.store.dram.gate.enter();
        let released = std::sync::Mutex::new(None::<Instant>);
        let calls = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(300));
                *released.lock().unwrap() = Some(Instant::now());
                drop(held);
            });
            pin_in_background(&reg, first, len, chunk, &progress, |off, n| {
                calls.lock().unwrap().push((off, n, Instant::now()));
            });
        });
        let calls = calls.into_inner().unwrap();
        let offsets: Vec<_> = calls.iter().map(|c| (c.0, c.1)).collect();
        assert_eq!(offsets, (first..len).step_by(chunk).map(|o| (o, chunk)).collect::<Vec<_>>());
        let released = released.into_inner().unwrap().expect("the registration ended");
        assert!(
            calls[0].2 >= released + QUIET,
            "the first chunk went {:?} after the registration ended, inside the quiet period",
            calls[0].2 - released
        );
        assert_eq!(progress.prefix(), len);
        assert_eq!(reg.store.dram.registration().0, len as u64);
    }

    #[test]
    fn foreground_work_holds_the_gate_until_dropped() {
        let gate = crate::store::dram::ForegroundGate::default();
        let quiet = Duration::from_millis(200);
        assert!(!gate.busy(quiet));
        let a = gate.enter();
        let b = gate.enter();
        drop(a);
        assert!(gate.busy(Duration::ZERO), "one registration still runs");
        drop(b);
        assert!(gate.busy(quiet), "the next registration of a burst may come");
        std::thread::sleep(quiet);
        assert!(!gate.busy(quiet), "quiet for the whole period");
    }
}
