//! The DRAM tier: one memfd holding every object, optionally on huge pages, bound to a
//! NUMA node and prefaulted. Never shared with peers: the pool alone copies in and out.

use umbp_ipc::SharedMemory;

use crate::config::PoolConfig;
use crate::PoolError;

pub struct Dram {
    mem: SharedMemory,
}

// SAFETY: plain memory; which bytes are touched by whom is decided by the object store
// (an object is written only while reserved, read only while pinned or published).
unsafe impl Sync for Dram {}

const MPOL_BIND: libc::c_ulong = 2;
const MPOL_MF_STRICT: libc::c_ulong = 1;

impl Dram {
    pub fn create(config: &PoolConfig) -> Result<Self, PoolError> {
        let mem = SharedMemory::create("umbp-dram", config.capacity_bytes as usize, config.hugepages)
            .map_err(|e| PoolError::Dram(format!("{e} (capacity {} bytes, hugepages {})", config.capacity_bytes, config.hugepages)))?;
        let dram = Self { mem };
        if let Some(node) = config.numa_node {
            dram.bind_numa(node)?;
        }
        if config.prefault {
            dram.prefault();
        }
        Ok(dram)
    }

    fn bind_numa(&self, node: u32) -> Result<(), PoolError> {
        if node >= 1024 {
            return Err(PoolError::Dram(format!("numa-node {node} is out of range")));
        }
        let mut mask = [0u64; 16];
        mask[(node / 64) as usize] |= 1 << (node % 64);
        // SAFETY: mbind on our own mapping with a nodemask buffer of 1024 bits.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_mbind,
                self.mem.as_ptr(),
                self.mem.len(),
                MPOL_BIND,
                mask.as_ptr(),
                1025usize,
                MPOL_MF_STRICT,
            )
        };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            return Err(PoolError::Dram(format!("numa-node {node}: mbind failed: {err} (is there such a node in /sys/devices/system/node?)")));
        }
        tracing::info!(node, "DRAM bound to NUMA node");
        Ok(())
    }

    /// Faults every page in now, in 1 GiB steps with a progress bar, so the first stores
    /// do not pay for page faults.
    fn prefault(&self) {
        const STEP: usize = 1 << 30;
        let len = self.mem.len();
        let bar = indicatif::ProgressBar::new(len as u64).with_message("prefaulting DRAM");
        bar.set_style(
            indicatif::ProgressStyle::with_template("{msg} {bar:40} {bytes}/{total_bytes} ({eta})")
                .expect("static template"),
        );
        let mut off = 0;
        while off < len {
            let n = STEP.min(len - off);
            // SAFETY: a range of our own mapping. MADV_POPULATE_WRITE (Linux 5.14) faults
            // pages in writable without changing their contents.
            let rc = unsafe { libc::madvise(self.mem.as_ptr().add(off).cast(), n, 23 /* MADV_POPULATE_WRITE */) };
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
            bar.set_position(off as u64);
        }
        bar.finish_and_clear();
        tracing::info!(bytes = len, "DRAM prefaulted");
    }

    pub fn base(&self) -> *mut u8 {
        self.mem.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.mem.len()
    }

    pub fn is_empty(&self) -> bool {
        self.mem.is_empty()
    }
}
