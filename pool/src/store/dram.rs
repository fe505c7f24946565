//! The DRAM tier: one memfd holding every object, optionally on huge pages, bound to a
//! NUMA node and prefaulted. Never shared with peers: the pool alone copies in and out.

use umbp_ipc::SharedMemory;

use crate::config::PoolConfig;

/// Why the DRAM tier could not be made (the pool's start fails with it).
#[derive(Debug, thiserror::Error)]
pub enum DramError {
    #[error("DRAM tier: {source} (capacity {capacity_bytes} bytes){}", if *.hugepages { HUGEPAGES_HINT } else { "" })]
    Memory { capacity_bytes: u64, hugepages: bool, source: umbp_ipc::ShmError },
    #[error("DRAM tier: numa-node {0} is out of range")]
    NumaNodeRange(u32),
    #[error("DRAM tier: numa-node {node}: mbind failed: {source} (is there such a node in /sys/devices/system/node?)")]
    Mbind { node: u32, source: std::io::Error },
}

const HUGEPAGES_HINT: &str =
    "; --hugepages needs that many 2 MiB pages reserved first (sysctl vm.nr_hugepages, see /proc/meminfo HugePages_Free)";

pub struct Dram {
    mem: SharedMemory,
    /// Bytes registered with the GPU drivers so far, from the start of the tier.
    registered: std::sync::atomic::AtomicU64,
    /// Background registration finished (or there was none to do).
    registration_done: std::sync::atomic::AtomicBool,
    /// Foreground GPU work the background registration steps aside for (pinning.rs).
    pub(crate) gate: ForegroundGate,
}

/// Foreground GPU driver work (a worker's memory registration) that the background DRAM
/// registration steps aside for. The driver serializes host registration with other
/// context work: measured on an H100 host, a worker's first CUDA registration waited 39.6 s
/// for the whole 64 GiB background registration (issue #33 item 4). Registrations come in
/// bursts (an engine registers every layer's KV tensors), so the background also waits
/// out a short quiet period after the last one.
#[derive(Default)]
pub(crate) struct ForegroundGate {
    active: std::sync::atomic::AtomicU32,
    last_exit: std::sync::Mutex<Option<std::time::Instant>>,
}

/// Foreground work in progress while held.
pub(crate) struct Foreground<'a>(&'a ForegroundGate);

impl ForegroundGate {
    pub(crate) fn enter(&self) -> Foreground<'_> {
        // Relaxed: a hint that only delays the next chunk; no data is published through it.
        self.active.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Foreground(self)
    }

    /// Foreground work runs now or ended less than `quiet` ago.
    pub(crate) fn busy(&self, quiet: std::time::Duration) -> bool {
        self.active.load(std::sync::atomic::Ordering::Relaxed) > 0
            || self.last_exit.lock().unwrap_or_else(|e| e.into_inner()).is_some_and(|t| t.elapsed() < quiet)
    }
}

impl Drop for Foreground<'_> {
    fn drop(&mut self) {
        *self.0.last_exit.lock().unwrap_or_else(|e| e.into_inner()) = Some(std::time::Instant::now());
        self.0.active.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

// SAFETY: plain memory; which bytes are touched by whom is decided by the object store
// (an object is written only while reserved, read only while pinned or published).
unsafe impl Sync for Dram {}

const MPOL_BIND: libc::c_ulong = 2;
const MPOL_MF_STRICT: libc::c_ulong = 1;

impl Dram {
    pub fn create(config: &PoolConfig) -> Result<Self, DramError> {
        let mem = SharedMemory::create("umbp-dram", config.capacity_bytes as usize, config.hugepages)
            .map_err(|source| DramError::Memory { capacity_bytes: config.capacity_bytes, hugepages: config.hugepages, source })?;
        let dram = Self {
            mem,
            registered: std::sync::atomic::AtomicU64::new(0),
            registration_done: std::sync::atomic::AtomicBool::new(false),
            gate: ForegroundGate::default(),
        };
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

    fn bind_numa(&self, node: u32) -> Result<(), DramError> {
        if node >= 1024 {
            return Err(DramError::NumaNodeRange(node));
        }
        let mut mask = [0u64; 16];
        mask[(node / 64) as usize] |= 1 << (node % 64);
        // SAFETY: mbind on our own mapping with a nodemask buffer of 1024 bits.
        let rc = unsafe {
            libc::syscall(libc::SYS_mbind, self.mem.as_ptr(), self.mem.len(), MPOL_BIND, mask.as_ptr(), 1025usize, MPOL_MF_STRICT)
        };
        if rc != 0 {
            return Err(DramError::Mbind { node, source: std::io::Error::last_os_error() });
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
            let p = crate::config::Progress { what: "prefaulting DRAM", done_bytes: done as u64, total_bytes: len as u64 };
            tracing::debug!(done_bytes = p.done_bytes, total_bytes = p.total_bytes, "{}", p.what);
            if let Some(f) = progress {
                f.call(&p);
            }
        };
        report(0);
        let mut off = 0;
        while off < len {
            let n = STEP.min(len - off);
            self.populate(off, n);
            off += n;
            report(off);
        }
        tracing::info!(bytes = len, "DRAM prefaulted");
    }

    /// Faults `[off, off + n)` in, writable, keeping its contents: what the driver's host
    /// registration would otherwise do itself, at a fraction of memory speed and while it
    /// holds a lock every other process's GPU driver calls wait for.
    pub(crate) fn populate(&self, off: usize, n: usize) {
        debug_assert!(off + n <= self.mem.len());
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

    /// Records that `[0, bytes)` is registered (Release: pairs with `registration`'s
    /// Acquire, so a reader that sees the count sees the allocator limit set before it).
    pub(crate) fn set_registered(&self, bytes: u64) {
        self.registered.store(bytes, std::sync::atomic::Ordering::Release);
    }

    pub(crate) fn set_registration_done(&self) {
        self.registration_done.store(true, std::sync::atomic::Ordering::Release);
    }
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
