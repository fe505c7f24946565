//! Registering (pinning) the DRAM tier with every GPU driver present, so copies to and from
//! GPUs run as DMA from pinned memory. The first 256 MiB is registered before the pool
//! listens (it can take stores at once); the rest on background threads, since pinning
//! hundreds of GiB takes minutes. Meanwhile the allocator hands out only the registered
//! prefix (`page_limit`), a worker's own GPU registration goes first (`ForegroundGate`),
//! and progress is logged and reported (`dram_registered_bytes`).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use umbp_protocol::wire::MemoryKind;

use crate::PoolInner;

/// What to unregister at stop: each backend with the base of every chunk it pinned.
pub type Registrations = Vec<(Arc<dyn umbp_gpu::Backend>, usize)>;

/// Registered before the pool listens.
const FIRST_CHUNK: usize = 256 << 20;
/// One background step: a multiple of the 2 MiB slab page (no slab object straddles two
/// registrations), small enough that foreground work waits at most one step (~80 ms at the
/// 1.6 GiB/s the driver pins on an H100 host).
const CHUNK: usize = 128 << 20;
/// Background threads pinning at once. One: measured on the H200 host (2026-12-05), four
/// threads pinned 64 GiB at 1.74 GiB/s against 1.61 GiB/s for one (H100 host): the driver
/// serializes registration, and every thread mid-chunk is one more chunk a worker's
/// registration waits for.
const THREADS: usize = 1;
/// After a worker's GPU registration, the background waits this long for the next one of
/// the same burst before it pins again.
const QUIET: Duration = Duration::from_millis(250);
/// How long one chunk waits for foreground work to end before it goes anyway, so a
/// stream of registrations cannot keep the pool from ever registering its DRAM.
const MAX_YIELD: Duration = Duration::from_secs(10);
/// Progress lines at most this often (a 512 GiB pool has 2,048 chunks).
const PROGRESS_EVERY: Duration = Duration::from_secs(2);

/// Starts the registration: the first chunk now, the rest on background threads. Returns
/// the thread that joins them (its result: what to unregister at stop), or None when no
/// GPU driver sees a device (nothing to register) or the thread could not start.
pub fn register_with_gpus(inner: &Arc<PoolInner>) -> Option<std::thread::JoinHandle<Registrations>> {
    // A backend whose library loads but sees no device (a CUDA driver on a GPU-less
    // machine) cannot register anything: skip it instead of failing every chunk.
    let backends: Vec<_> = [MemoryKind::Cuda, MemoryKind::Hip]
        .into_iter()
        .filter(|k| match k {
            MemoryKind::Cuda => umbp_gpu::cuda::device_count().is_ok_and(|n| n > 0),
            _ => umbp_gpu::hip::device_count().is_ok_and(|n| n > 0),
        })
        .filter_map(|k| umbp_gpu::backend_for(k).ok())
        .collect();
    if backends.is_empty() {
        tracing::debug!("no GPU driver found: DRAM stays unregistered (host backends only)");
        inner.dram.set_registration_done();
        return None;
    }
    inner.store.lock().expect("store lock").set_page_limit(0);
    let len = inner.dram.len();
    let threads = THREADS;
    tracing::info!(
        total_bytes = len,
        backends = backends.len(),
        threads,
        "registering DRAM with the GPU driver (the first {} MiB now, the rest in the background)",
        FIRST_CHUNK >> 20
    );
    let first = FIRST_CHUNK.min(len);
    let progress = Progress::new(len);
    let mut done = Registrations::new();
    register_range(inner, &backends, 0, first, &mut done);
    progress.finished(inner, 0, first);
    let outer = inner.clone();
    let inner = inner.clone();
    let t = std::thread::Builder::new().name("umbp-register".into()).spawn(move || {
        let chunks = (len - first).div_ceil(CHUNK);
        let next = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    let (inner, backends, next, progress) = (&inner, &backends, &next, &progress);
                    scope.spawn(move || {
                        let mut mine = Registrations::new();
                        loop {
                            yield_to_foreground(inner);
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            if i >= chunks || inner.is_shutting_down() {
                                return mine;
                            }
                            let off = first + i * CHUNK;
                            let n = CHUNK.min(len - off);
                            register_range(inner, backends, off, n, &mut mine);
                            progress.finished(inner, off, n);
                        }
                    })
                })
                .collect();
            for w in workers {
                done.extend(w.join().expect("a DRAM registration thread panicked"));
            }
        });
        inner.store.lock().expect("store lock").set_page_limit(u32::MAX);
        inner.dram.set_registration_done();
        tracing::info!(
            bytes = progress.prefix(),
            elapsed_s = progress.started.elapsed().as_secs_f64(),
            gib_per_s = progress.rate(),
            threads,
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
            outer.store.lock().expect("store lock").set_page_limit(u32::MAX);
            outer.dram.set_registration_done();
            None
        }
    }
}

/// Waits (bounded) while a worker's GPU registration is in progress.
fn yield_to_foreground(inner: &PoolInner) {
    let until = Instant::now() + MAX_YIELD;
    while inner.dram.gate.busy(QUIET) && Instant::now() < until && !inner.is_shutting_down() {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Registers `[off, off + n)` of DRAM with every backend.
fn register_range(inner: &PoolInner, backends: &[Arc<dyn umbp_gpu::Backend>], off: usize, n: usize, done: &mut Registrations) {
    let base = inner.dram.base() as usize;
    for b in backends {
        // SAFETY: a chunk of the DRAM mapping, which outlives the pool's threads;
        // unregistered in `Pool::stop` after every copy thread has exited.
        match unsafe { b.register_host_memory((base + off) as *mut u8, n) } {
            Ok(()) => done.push((b.clone(), base + off)),
            Err(e) => tracing::warn!(offset = off, "registering DRAM with {:?} failed: {e}; copies there will be staged", b.kind()),
        }
    }
}

/// Chunks finish out of order on several threads; the allocator may use only the
/// registered prefix, so this tracks which chunks are done and how far the prefix reaches.
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
    fn finished(&self, inner: &PoolInner, off: usize, n: usize) {
        self.advance(off, n, |prefix| {
            inner.store.lock().expect("store lock").set_page_limit((prefix as u64 / crate::config::PAGE_BYTES) as u32);
            inner.dram.set_registered(prefix as u64);
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
