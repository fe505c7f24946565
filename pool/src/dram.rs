//! The DRAM tier: one memfd holding every object, optionally on huge pages, bound to a
//! NUMA node and prefaulted. Never shared with peers: the pool alone copies in and out.

use umbp_ipc::SharedMemory;

use crate::config::PoolConfig;
use crate::PoolError;

pub struct Dram {
    mem: SharedMemory,
    /// Bytes registered with the GPU drivers so far, from the start of the tier.
    registered: std::sync::atomic::AtomicU64,
    /// Background registration finished (or there was none to do).
    registration_done: std::sync::atomic::AtomicBool,
}

// SAFETY: plain memory; which bytes are touched by whom is decided by the object store
// (an object is written only while reserved, read only while pinned or published).
unsafe impl Sync for Dram {}

const MPOL_BIND: libc::c_ulong = 2;
const MPOL_MF_STRICT: libc::c_ulong = 1;

impl Dram {
    pub fn create(config: &PoolConfig) -> Result<Self, PoolError> {
        let mem = SharedMemory::create("umbp-dram", config.capacity_bytes as usize, config.hugepages)
            .map_err(|source| PoolError::Dram { capacity_bytes: config.capacity_bytes, hugepages: config.hugepages, source })?;
        let dram =
            Self { mem, registered: std::sync::atomic::AtomicU64::new(0), registration_done: std::sync::atomic::AtomicBool::new(false) };
        dram.exclude_from_core_dumps();
        if let Some(node) = config.numa_node {
            dram.bind_numa(node)?;
        }
        if config.prefault {
            dram.prefault(config.progress.as_ref());
        }
        Ok(dram)
    }

    /// Every tenant's KV lives here: a core dump of the pool (or of a crash handler's) must
    /// not carry it (`MADV_DONTDUMP`; docs/security.md, "Memory of the pool").
    fn exclude_from_core_dumps(&self) {
        // SAFETY: madvise on exactly our own mapping; DONTDUMP changes only core dumps.
        let rc = unsafe { libc::madvise(self.mem.as_ptr().cast(), self.mem.len(), libc::MADV_DONTDUMP) };
        if rc != 0 {
            tracing::warn!(error = %std::io::Error::last_os_error(), "madvise(MADV_DONTDUMP) on pool DRAM failed: a core dump of the pool would hold its objects");
        }
    }

    fn bind_numa(&self, node: u32) -> Result<(), PoolError> {
        if node >= 1024 {
            return Err(PoolError::NumaNodeRange(node));
        }
        let mut mask = [0u64; 16];
        mask[(node / 64) as usize] |= 1 << (node % 64);
        // SAFETY: mbind on our own mapping with a nodemask buffer of 1024 bits.
        let rc = unsafe {
            libc::syscall(libc::SYS_mbind, self.mem.as_ptr(), self.mem.len(), MPOL_BIND, mask.as_ptr(), 1025usize, MPOL_MF_STRICT)
        };
        if rc != 0 {
            return Err(PoolError::Mbind { node, source: std::io::Error::last_os_error() });
        }
        tracing::info!(node, "DRAM bound to NUMA node");
        Ok(())
    }

    /// Faults every page in now, in 1 GiB steps, so the first stores do not pay for page
    /// faults. Each step is reported to `progress` (the daemon draws a bar) and logged at
    /// debug level.
    fn prefault(&self, progress: Option<&crate::config::ProgressFn>) {
        const STEP: usize = 1 << 30;
        let len = self.mem.len();
        let report = |done: usize| {
            let p = crate::Progress { what: "prefaulting DRAM", done_bytes: done as u64, total_bytes: len as u64 };
            tracing::debug!(done_bytes = p.done_bytes, total_bytes = p.total_bytes, "{}", p.what);
            if let Some(f) = progress {
                f.call(&p);
            }
        };
        report(0);
        let mut off = 0;
        while off < len {
            let n = STEP.min(len - off);
            // SAFETY: a range of our own mapping. MADV_POPULATE_WRITE (Linux 5.14) faults
            // pages in writable without changing their contents.
            let rc = unsafe {
                libc::madvise(self.mem.as_ptr().add(off).cast(), n, 23 /* MADV_POPULATE_WRITE */)
            };
            if rc != 0 {
                // Older kernels: touch one byte per page.
                let mut p = off;
                while p < off + n {
                    // SAFETY: inside our mapping; reading and writing back the same byte.
                    unsafe {
                        let b = self.mem.as_ptr().add(p);
                        b.write_volatile(b.read_volatile());
                    }
                    p += 4096;
                }
            }
            off += n;
            report(off);
        }
        tracing::info!(bytes = len, "DRAM prefaulted");
    }

    pub fn base(&self) -> *mut u8 {
        self.mem.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.mem.len()
    }

    /// `(bytes registered with GPU drivers, whether background registration is over)`.
    pub fn registration(&self) -> (u64, bool) {
        use std::sync::atomic::Ordering;
        (self.registered.load(Ordering::Acquire), self.registration_done.load(Ordering::Acquire))
    }
}

/// What to unregister at stop: each backend with the base of every chunk it pinned.
pub type Registrations = Vec<(std::sync::Arc<dyn umbp_gpu::Backend>, usize)>;

/// Registers DRAM with every GPU driver present, in 1 GiB chunks from the start of the
/// tier: the first 256 MiB before returning (so a pool that says it is listening can take
/// stores at once; measured up to 0.85 s per GiB without prefault), the rest on a
/// background thread, since pinning hundreds of GiB takes minutes. The allocator hands out
/// only registered pages meanwhile (`page_limit`), so the pool serves from the registered
/// part. Chunks are multiples of the 2 MiB slab page, so no slab object straddles two
/// registrations; multi-page objects may, and the GPU engine cuts copies at registration
/// ends. Progress is logged (info) every chunk with the rate so far. Returns the backends
/// and chunk bases to unregister at stop.
pub fn register_with_gpus(inner: &std::sync::Arc<crate::PoolInner>) -> Option<std::thread::JoinHandle<Registrations>> {
    use std::sync::atomic::Ordering;
    use umbp_protocol::wire::MemoryKind;
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
        inner.dram.registration_done.store(true, Ordering::Release);
        return None;
    }
    inner.store.lock().expect("store lock").set_page_limit(0);
    const FIRST_CHUNK: usize = 256 << 20;
    const CHUNK: usize = 1 << 30;
    let len = inner.dram.len();
    let started = std::time::Instant::now();
    tracing::info!(
        total_bytes = len,
        backends = backends.len(),
        "registering DRAM with the GPU driver (the first {} MiB now, the rest in the background)",
        FIRST_CHUNK >> 20
    );
    let mut done = Registrations::new();
    let first = FIRST_CHUNK.min(len);
    register_chunk(inner, &backends, 0, first, started, &mut done);
    let outer = inner.clone();
    let inner = inner.clone();
    let t = std::thread::Builder::new().name("umbp-register".into()).spawn(move || {
        let mut off = first;
        while off < len && !inner.is_shutting_down() {
            let n = CHUNK.min(len - off);
            register_chunk(&inner, &backends, off, n, started, &mut done);
            off += n;
        }
        inner.store.lock().expect("store lock").set_page_limit(u32::MAX);
        inner.dram.registration_done.store(true, Ordering::Release);
        tracing::info!(bytes = off, elapsed_s = started.elapsed().as_secs_f64(), "DRAM registration done");
        done
    });
    match t {
        Ok(t) => Some(t),
        Err(e) => {
            // Serve unregistered (staged copies) rather than never hand out a page. The
            // first chunk stays registered until the process exits.
            tracing::warn!("cannot start the DRAM registration thread: {e}; DRAM past the first chunk stays unregistered");
            outer.store.lock().expect("store lock").set_page_limit(u32::MAX);
            outer.dram.registration_done.store(true, Ordering::Release);
            None
        }
    }
}

/// Registers `[off, off + n)` of DRAM with every backend, then lets the allocator hand out
/// pages up to its end and logs the progress.
fn register_chunk(
    inner: &crate::PoolInner,
    backends: &[std::sync::Arc<dyn umbp_gpu::Backend>],
    off: usize,
    n: usize,
    started: std::time::Instant,
    done: &mut Registrations,
) {
    use std::sync::atomic::Ordering;
    let base = inner.dram.base() as usize;
    for b in backends {
        // SAFETY: a chunk of the DRAM mapping, which outlives the pool's threads;
        // unregistered in `Pool::stop` after every copy thread has exited.
        match unsafe { b.register_host_memory((base + off) as *mut u8, n) } {
            Ok(()) => done.push((b.clone(), base + off)),
            Err(e) => tracing::warn!(offset = off, "registering DRAM with {:?} failed: {e}; copies there will be staged", b.kind()),
        }
    }
    let end = off + n;
    inner.store.lock().expect("store lock").set_page_limit((end as u64 / crate::PAGE_BYTES) as u32);
    inner.dram.registered.store(end as u64, Ordering::Release);
    let secs = started.elapsed().as_secs_f64();
    tracing::info!(
        registered_bytes = end,
        total_bytes = inner.dram.len(),
        elapsed_s = secs,
        gib_per_s = end as f64 / (1u64 << 30) as f64 / secs.max(1e-9),
        "DRAM registration progress"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `VmFlags` line of the mapping that starts at `addr`, from /proc/self/smaps.
    fn vm_flags(addr: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((start, _)) = range.split_once('-') {
                    if let Ok(start) = usize::from_str_radix(start, 16) {
                        inside = start == addr;
                        continue;
                    }
                }
            }
            if inside {
                if let Some(flags) = line.strip_prefix("VmFlags:") {
                    return flags.trim().to_string();
                }
            }
        }
        panic!("no mapping at {addr:#x} in /proc/self/smaps")
    }

    #[test]
    fn pool_dram_is_left_out_of_core_dumps() {
        let config = PoolConfig { capacity_bytes: 4 << 20, prefault: false, hugepages: false, numa_node: None, ..PoolConfig::default() };
        let dram = Dram::create(&config).unwrap();
        let flags = vm_flags(dram.base() as usize);
        // "dd": do not include in a core dump (MADV_DONTDUMP).
        assert!(flags.split_whitespace().any(|f| f == "dd"), "DRAM mapping flags without dd: {flags}");
    }
}
