//! Host backends (DESIGN §7): "device" memory that is ordinary DRAM of a worker, for CPU
//! engines and for tests that run without a GPU.
//!
//! - [`MemoryKind::HostMemfd`]: the worker passes a memfd at registration; the pool maps
//!   `offset..offset+size` shared and copies with memcpy. The memfd must carry
//!   `F_SEAL_SHRINK`: a peer that truncated the file under the pool's mapping would turn the
//!   pool's next copy into a SIGBUS, killing every engine's cache at once. Unsealed fds are
//!   refused.
//! - [`MemoryKind::HostProcess`]: any memory of the worker process, read and written with
//!   `process_vm_readv/writev` against the worker's pid. A dead peer or an unmapped range
//!   is an error from the kernel, so the pool never crashes on it.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use rustix::fs::SealFlags;
use rustix::mm::{MapFlags, ProtFlags};
use rustix::process::{Pid, PidfdFlags};

use crate::{
    check_ops, expect_kind, new_registration, Backend, CopyOp, DeviceRegion, GpuError, MemoryKind,
    MemoryRegistration,
};

/// Most iovecs one process_vm_readv/writev call accepts (UIO_MAXIOV).
const IOV_MAX: usize = 1024;

/// Backend of [`MemoryKind::HostMemfd`]. Pool memory needs no registration.
pub struct HostMemfdBackend;

/// Backend of [`MemoryKind::HostProcess`]. Pool memory needs no registration.
pub struct HostProcessBackend;

impl Backend for HostMemfdBackend {
    fn kind(&self) -> MemoryKind {
        MemoryKind::HostMemfd
    }

    unsafe fn register_host_memory(&self, _base: *mut u8, _len: usize) -> Result<(), GpuError> {
        Ok(())
    }

    unsafe fn unregister_host_memory(&self, _base: *mut u8) -> Result<(), GpuError> {
        Ok(())
    }

    fn open_region(
        &self,
        reg: &MemoryRegistration,
        fd: Option<OwnedFd>,
        _peer_pid: u32,
    ) -> Result<Box<dyn DeviceRegion>, GpuError> {
        expect_kind(MemoryKind::HostMemfd, reg)?;
        let fd = fd.ok_or_else(|| {
            GpuError::invalid(
                MemoryKind::HostMemfd,
                "registration arrived without its memfd",
            )
        })?;
        Ok(Box::new(MemfdRegion::open(reg, fd)?))
    }
}

impl Backend for HostProcessBackend {
    fn kind(&self) -> MemoryKind {
        MemoryKind::HostProcess
    }

    unsafe fn register_host_memory(&self, _base: *mut u8, _len: usize) -> Result<(), GpuError> {
        Ok(())
    }

    unsafe fn unregister_host_memory(&self, _base: *mut u8) -> Result<(), GpuError> {
        Ok(())
    }

    fn open_region(
        &self,
        reg: &MemoryRegistration,
        _fd: Option<OwnedFd>,
        peer_pid: u32,
    ) -> Result<Box<dyn DeviceRegion>, GpuError> {
        expect_kind(MemoryKind::HostProcess, reg)?;
        Ok(Box::new(ProcessRegion::open(reg, peer_pid)?))
    }
}

/// Checks that `fd` is a memfd sealed against shrinking and at least `offset + len` long.
/// Returns its seals.
fn check_memfd(fd: BorrowedFd<'_>, offset: u64, len: u64) -> Result<SealFlags, GpuError> {
    let kind = MemoryKind::HostMemfd;
    // F_GET_SEALS fails with EINVAL on anything but a memfd (or other sealable shmem file),
    // which is exactly the set of files whose size seals we can trust.
    let seals = rustix::fs::fcntl_get_seals(fd).map_err(|e| {
        GpuError::invalid(
            kind,
            format!("fd is not a memfd (F_GET_SEALS: {})", io::Error::from(e)),
        )
    })?;
    if !seals.contains(SealFlags::SHRINK) {
        return Err(GpuError::NotSealed {
            seals: seals.bits(),
        });
    }
    if len == 0 {
        return Err(GpuError::invalid(kind, "size is 0"));
    }
    let end = offset.checked_add(len).ok_or_else(|| {
        GpuError::invalid(kind, format!("offset {offset} + size {len} overflows"))
    })?;
    let st = rustix::fs::fstat(fd).map_err(|e| GpuError::os("fstat of memfd", e))?;
    if end > st.st_size as u64 {
        return Err(GpuError::invalid(
            kind,
            format!(
                "range {offset}..{end} passes the memfd's end at {}",
                st.st_size
            ),
        ));
    }
    Ok(seals)
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

/// A HostMemfd registration mapped shared into the pool.
struct MemfdRegion {
    alloc_id: u32,
    map: NonNull<libc::c_void>,
    map_len: usize,
    /// Start of the registered range inside the mapping (offset need not be page aligned).
    data: *mut u8,
    len: u64,
    /// False when the memfd is sealed against writes: loads into it are impossible.
    writable: bool,
    /// Set the first time the region serves as a fence page: its registration with the
    /// CUDA driver (None when there is no usable CUDA: fences are then CPU-only). Dropped
    /// before the mapping.
    fence_gpu: std::sync::OnceLock<Option<crate::cuda::HostWords>>,
    _fd: OwnedFd,
}

// SAFETY: the mapping is owned by the region and lives until drop; the raw pointers are
// only dereferenced inside copies, whose callers guarantee exclusive use of the host side.
// Concurrent copies into the peer range are the pool's scheduling concern, as with DMA.
unsafe impl Send for MemfdRegion {}
// SAFETY: as above; no interior state is mutated after open.
unsafe impl Sync for MemfdRegion {}

impl MemfdRegion {
    fn open(reg: &MemoryRegistration, fd: OwnedFd) -> Result<Self, GpuError> {
        let seals = check_memfd(fd.as_fd(), reg.offset, reg.size)?;
        let page = page_size();
        let aligned = reg.offset & !(page - 1);
        let map_len = usize::try_from(reg.offset - aligned + reg.size).map_err(|_| {
            GpuError::invalid(MemoryKind::HostMemfd, "size does not fit the address space")
        })?;
        let write_sealed = seals.intersects(SealFlags::WRITE | SealFlags::FUTURE_WRITE);
        let map_with = |prot: ProtFlags| {
            // SAFETY: a fresh shared mapping of a file whose size was checked above and
            // cannot shrink (F_SEAL_SHRINK), so every mapped page stays backed.
            unsafe {
                rustix::mm::mmap(
                    std::ptr::null_mut(),
                    map_len,
                    prot,
                    MapFlags::SHARED,
                    &fd,
                    aligned,
                )
            }
        };
        let (map, writable) = if write_sealed {
            (map_with(ProtFlags::READ), false)
        } else {
            match map_with(ProtFlags::READ | ProtFlags::WRITE) {
                // The worker may have passed an fd opened read-only: serve stores at least.
                Err(rustix::io::Errno::ACCESS) | Err(rustix::io::Errno::PERM) => {
                    (map_with(ProtFlags::READ), false)
                }
                other => (other, true),
            }
        };
        let map = map.map_err(|e| GpuError::os("mmap of memfd", e))?;
        let map = NonNull::new(map)
            .ok_or_else(|| GpuError::os("mmap of memfd", io::Error::other("null mapping")))?;
        // SAFETY: offset - aligned < page <= map_len, inside the mapping.
        let data = unsafe {
            map.as_ptr()
                .cast::<u8>()
                .add((reg.offset - aligned) as usize)
        };
        Ok(Self {
            alloc_id: reg.alloc_id,
            map,
            map_len,
            data,
            len: reg.size,
            writable,
            fence_gpu: std::sync::OnceLock::new(),
            _fd: fd,
        })
    }
}

impl Drop for MemfdRegion {
    fn drop(&mut self) {
        // Unregister from the GPU driver before the pages go.
        drop(self.fence_gpu.take());
        // SAFETY: unmaps exactly the mapping made in open; no copy can be running because
        // copies borrow self.
        if let Err(e) = unsafe { rustix::mm::munmap(self.map.as_ptr(), self.map_len) } {
            tracing::warn!("munmap of memfd region failed: {e}");
        }
    }
}

impl DeviceRegion for MemfdRegion {
    fn kind(&self) -> MemoryKind {
        MemoryKind::HostMemfd
    }

    fn fence_word(&self, slot: u32) -> Result<crate::FenceWord<'_>, GpuError> {
        use crate::fence::{MAX_FENCE_REGION_BYTES, SLOT_BYTES};
        let kind = MemoryKind::HostMemfd;
        if self.len > MAX_FENCE_REGION_BYTES {
            // The pool pins a fence page: a worker must not make it pin gigabytes.
            return Err(GpuError::invalid(kind, format!("{} bytes is too large for a fence page (at most {MAX_FENCE_REGION_BYTES})", self.len)));
        }
        if !self.writable {
            return Err(GpuError::invalid(kind, "a fence page must be writable by the pool"));
        }
        let off = slot as u64 * SLOT_BYTES;
        // Address arithmetic only (wrapping: checked before any use).
        let word = self.data.wrapping_add(off as usize);
        if off + SLOT_BYTES > self.len || !(word as usize).is_multiple_of(8) {
            return Err(GpuError::invalid(kind, format!("fence slot {slot} is outside the page or misaligned")));
        }
        let gpu = self.fence_gpu.get_or_init(|| {
            if !crate::cuda::device_count().is_ok_and(|n| n > 0) {
                return None;
            }
            // SAFETY: the whole mapping, which outlives the registration (dropped first in
            // Drop); null stream: device 0's primary context (the pool's engine holds it).
            match unsafe { crate::cuda::HostWords::register(self.map.as_ptr().cast(), self.map_len, std::ptr::null_mut()) } {
                Ok(w) => Some(w),
                Err(e) => {
                    tracing::warn!("fence page not registered with CUDA ({e}); fences wait on the CPU");
                    None
                }
            }
        });
        let device = gpu.as_ref().map(|g| g.device() + (word as u64 - self.map.as_ptr() as u64));
        // SAFETY: aligned, inside the writable shared mapping that lives as long as
        // `self` (the returned word borrows it); only accessed atomically.
        Ok(unsafe { crate::FenceWord::new(word.cast(), device) })
    }

    fn len(&self) -> u64 {
        self.len
    }

    unsafe fn copy_to_host(&self, ops: &[CopyOp], host_base: *mut u8) -> Result<(), GpuError> {
        check_ops(ops, self.alloc_id, self.len)?;
        for op in ops {
            // SAFETY: the source lies inside the mapping (check_ops); the destination is
            // valid pool memory by the caller's contract. A peer writing its side at the same
            // time can only give torn bytes, which the protocol orders out (stores are
            // submitted after the worker's writes).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.data.add(op.device_offset as usize),
                    host_base.add(op.host_offset as usize),
                    op.len as usize,
                )
            };
        }
        Ok(())
    }

    unsafe fn copy_from_host(&self, ops: &[CopyOp], host_base: *const u8) -> Result<(), GpuError> {
        if !self.writable {
            return Err(GpuError::Unsupported(
                "memfd region is read-only (write-sealed or opened read-only): cannot load into it"
                    .into(),
            ));
        }
        check_ops(ops, self.alloc_id, self.len)?;
        for op in ops {
            // SAFETY: the destination lies inside the writable mapping (check_ops); the
            // source is valid pool memory by the caller's contract.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    host_base.add(op.host_offset as usize),
                    self.data.add(op.device_offset as usize),
                    op.len as usize,
                )
            };
        }
        Ok(())
    }
}

/// A HostProcess registration: a range of the worker's address space.
struct ProcessRegion {
    alloc_id: u32,
    pid: u32,
    address: u64,
    len: u64,
    /// Becomes readable when the worker exits; checked before each batch so that a reused
    /// pid is not written to after the worker died (the pool also closes the region when
    /// the worker's socket closes, which bounds the window further).
    pidfd: OwnedFd,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// Peer -> pool (process_vm_readv).
    Read,
    /// Pool -> peer (process_vm_writev).
    Write,
}

impl Direction {
    fn call(self) -> &'static str {
        match self {
            Direction::Read => "process_vm_readv",
            Direction::Write => "process_vm_writev",
        }
    }
}

impl ProcessRegion {
    fn open(reg: &MemoryRegistration, peer_pid: u32) -> Result<Self, GpuError> {
        let kind = MemoryKind::HostProcess;
        let pid = i32::try_from(peer_pid)
            .ok()
            .and_then(Pid::from_raw)
            .ok_or_else(|| {
                GpuError::invalid(kind, format!("peer pid {peer_pid} is not a process id"))
            })?;
        if reg.size == 0 {
            return Err(GpuError::invalid(kind, "size is 0"));
        }
        if reg.address == 0
            || reg
                .address
                .checked_add(reg.size)
                .is_none_or(|end| end > isize::MAX as u64)
        {
            return Err(GpuError::invalid(
                kind,
                format!(
                    "address {:#x} + size {} is not a user range",
                    reg.address, reg.size
                ),
            ));
        }
        let pidfd = rustix::process::pidfd_open(pid, PidfdFlags::empty()).map_err(|e| match e {
            rustix::io::Errno::SRCH => GpuError::PeerGone { pid: peer_pid },
            e => GpuError::os("pidfd_open", e),
        })?;
        let region = Self {
            alloc_id: reg.alloc_id,
            pid: peer_pid,
            address: reg.address,
            len: reg.size,
            pidfd,
        };
        // Touch both ends now so that a permission problem (Yama, non-dumpable worker) or a
        // bad address surfaces at registration, where the worker gets a readable refusal,
        // instead of at the first store.
        let mut probe = [0u8; 1];
        for at in [0, reg.size - 1] {
            let op = CopyOp {
                alloc_id: reg.alloc_id,
                device_offset: at,
                host_offset: 0,
                len: 1,
            };
            // SAFETY: `probe` is one writable byte and the op copies one byte to offset 0.
            unsafe { region.transfer(&[op], probe.as_mut_ptr(), Direction::Read) }?;
        }
        Ok(region)
    }

    fn check_alive(&self) -> Result<(), GpuError> {
        let mut fds = [rustix::event::PollFd::new(
            &self.pidfd,
            rustix::event::PollFlags::IN,
        )];
        let zero = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        match rustix::event::poll(&mut fds, Some(&zero)) {
            Ok(0) => Ok(()),
            Ok(_) => Err(GpuError::PeerGone { pid: self.pid }),
            Err(e) => Err(GpuError::os("poll of pidfd", e)),
        }
    }

    /// Moves all ops in batches of up to IOV_MAX iovecs, resuming after partial transfers.
    ///
    /// # Safety
    /// `host[host_offset..+len]` is valid pool memory for each op, writable for reads.
    unsafe fn transfer(
        &self,
        ops: &[CopyOp],
        host: *mut u8,
        dir: Direction,
    ) -> Result<(), GpuError> {
        check_ops(ops, self.alloc_id, self.len)?;
        self.check_alive()?;
        let mut local: Vec<libc::iovec> = Vec::with_capacity(ops.len().min(IOV_MAX));
        let mut remote: Vec<libc::iovec> = Vec::with_capacity(ops.len().min(IOV_MAX));
        for batch in ops.chunks(IOV_MAX) {
            local.clear();
            remote.clear();
            for op in batch.iter().filter(|op| op.len > 0) {
                local.push(libc::iovec {
                    // SAFETY: in bounds of pool memory by the caller's contract.
                    iov_base: unsafe { host.add(op.host_offset as usize) }.cast(),
                    iov_len: op.len as usize,
                });
                remote.push(libc::iovec {
                    iov_base: (self.address + op.device_offset) as *mut libc::c_void,
                    iov_len: op.len as usize,
                });
            }
            // SAFETY: local iovecs are valid pool memory (caller); remote ones are checked
            // by the kernel against the peer's mappings.
            unsafe { self.transfer_iovecs(&mut local, &mut remote, dir) }?;
        }
        Ok(())
    }

    /// One batch; `local[i]` and `remote[i]` have equal lengths.
    ///
    /// # Safety
    /// Every local iovec is valid pool memory (writable for reads).
    unsafe fn transfer_iovecs(
        &self,
        local: &mut [libc::iovec],
        remote: &mut [libc::iovec],
        dir: Direction,
    ) -> Result<(), GpuError> {
        let mut start = 0;
        while start < local.len() {
            let (l, r) = (&local[start..], &remote[start..]);
            // SAFETY: the iovec arrays are live for the call; local buffers are valid by the
            // caller's contract; the kernel validates the remote side against the peer.
            let n = unsafe {
                match dir {
                    Direction::Read => libc::process_vm_readv(
                        self.pid as libc::pid_t,
                        l.as_ptr(),
                        l.len() as libc::c_ulong,
                        r.as_ptr(),
                        r.len() as libc::c_ulong,
                        0,
                    ),
                    Direction::Write => libc::process_vm_writev(
                        self.pid as libc::pid_t,
                        l.as_ptr(),
                        l.len() as libc::c_ulong,
                        r.as_ptr(),
                        r.len() as libc::c_ulong,
                        0,
                    ),
                }
            };
            let at = &remote[start];
            let fail = |source: io::Error| GpuError::PeerMemory {
                op: dir.call(),
                pid: self.pid,
                address: at.iov_base as u64,
                len: at.iov_len as u64,
                source,
            };
            if n < 0 {
                let err = io::Error::last_os_error();
                return Err(match err.raw_os_error() {
                    Some(libc::ESRCH) => GpuError::PeerGone { pid: self.pid },
                    _ => fail(err),
                });
            }
            let mut n = n as usize;
            if n == 0 {
                // No progress with bytes left: the first remote page is not mapped.
                return Err(fail(io::Error::from_raw_os_error(libc::EFAULT)));
            }
            // Skip fully transferred iovecs, then shorten the one the kernel stopped in
            // (it stops early at an unmapped page or after MAX_RW_COUNT bytes).
            while start < local.len() && n >= local[start].iov_len {
                n -= local[start].iov_len;
                start += 1;
            }
            if n > 0 {
                for v in [&mut local[start], &mut remote[start]] {
                    v.iov_base = (v.iov_base as usize + n) as *mut libc::c_void;
                    v.iov_len -= n;
                }
            }
        }
        Ok(())
    }
}

impl DeviceRegion for ProcessRegion {
    fn kind(&self) -> MemoryKind {
        MemoryKind::HostProcess
    }

    fn len(&self) -> u64 {
        self.len
    }

    unsafe fn copy_to_host(&self, ops: &[CopyOp], host_base: *mut u8) -> Result<(), GpuError> {
        // SAFETY: forwarded caller contract.
        unsafe { self.transfer(ops, host_base, Direction::Read) }
    }

    unsafe fn copy_from_host(&self, ops: &[CopyOp], host_base: *const u8) -> Result<(), GpuError> {
        // SAFETY: forwarded caller contract; process_vm_writev only reads the local side,
        // so the const-to-mut cast never leads to a write.
        unsafe { self.transfer(ops, host_base.cast_mut(), Direction::Write) }
    }
}

/// Worker side: registration of `len` bytes at `ptr` of this process as HostProcess memory.
///
/// Calls `prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)`: under Yama `ptrace_scope = 1` (the
/// default of most distributions) only ancestors may use process_vm_* on a process, and the
/// pool is not the worker's ancestor. This lets any process of the *same user* attach to the
/// worker, a weaker isolation than the default, and is why the GPU kinds are preferred on
/// shared machines. Without Yama the call fails with EINVAL, which means nothing is
/// restricted and is ignored. `ptrace_scope = 2` or `3` still refuse a non-root pool; the
/// pool then reports EPERM when it opens the region. The worker must also be dumpable (not
/// setuid, no PR_SET_DUMPABLE 0), checked here.
pub fn export_process_memory(
    ptr: *const u8,
    len: usize,
    alloc_id: u32,
) -> Result<MemoryRegistration, GpuError> {
    let kind = MemoryKind::HostProcess;
    if ptr.is_null() || len == 0 {
        return Err(GpuError::invalid(kind, "null pointer or zero length"));
    }
    match rustix::process::set_ptracer(rustix::process::PTracer::Any) {
        Ok(()) | Err(rustix::io::Errno::INVAL) => {}
        Err(e) => return Err(GpuError::os("prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)", e)),
    }
    match rustix::process::dumpable_behavior() {
        Ok(rustix::process::DumpableBehavior::Dumpable) => {}
        Ok(_) => {
            return Err(GpuError::invalid(kind, "this process is not dumpable (PR_SET_DUMPABLE 0 or setuid): the pool cannot reach its memory"))
        }
        Err(e) => return Err(GpuError::os("prctl(PR_GET_DUMPABLE)", e)),
    }
    Ok(new_registration(kind, alloc_id, ptr as u64, 0, len as u64))
}

/// Worker side: registration of `len` bytes at `offset` of memfd `fd` as HostMemfd memory.
/// The fd itself travels beside the message (SCM_RIGHTS). Refuses, as the pool would, an fd
/// that is not a memfd sealed with F_SEAL_SHRINK or is shorter than `offset + len`.
pub fn export_memfd(
    fd: BorrowedFd<'_>,
    offset: u64,
    len: u64,
    alloc_id: u32,
) -> Result<MemoryRegistration, GpuError> {
    check_memfd(fd, offset, len)?;
    Ok(new_registration(
        MemoryKind::HostMemfd,
        alloc_id,
        0,
        offset,
        len,
    ))
}
