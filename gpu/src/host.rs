//! Host backends (docs/gpu.md): "device" memory that is ordinary DRAM of a worker, for CPU
//! engines and for tests that run without a GPU.
//!
//! - [`MemoryKind::HostMemfd`]: the worker passes a memfd at registration; the pool maps
//!   `offset..offset+size` shared and copies with memcpy. The memfd must carry
//!   `F_SEAL_SHRINK`: a peer that truncated the file under the pool's mapping would turn the
//!   pool's next copy into a SIGBUS, killing every engine's cache at once. Unsealed fds are
//!   refused.
//!   A hugetlb memfd is refused unless it is also sealed against writes: punching a hole
//!   releases its pages and their reservation, and refaulting them fails with SIGBUS once
//!   the huge page pool is empty (docs/security.md, item 3).
//! - [`MemoryKind::HostProcess`]: any memory of the worker process, read and written
//!   through `/proc/<pid>/mem`, opened once at registration between two checks that the
//!   pid still is the process that connected and runs as the peer's uid
//!   ([`crate::Peer::verify`]). The open file is bound to that address space: if the
//!   process later executes another program (a setuid one, say), copies fail instead of
//!   reaching the new program. A dead peer or an unmapped range is an error from the
//!   kernel, so the pool never crashes on it.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use rustix::fs::SealFlags;
use rustix::mm::{MapFlags, ProtFlags};
use rustix::process::{Pid, PidfdFlags};

use crate::{check_ops, expect_kind, new_registration, Backend, CopyOp, DeviceRegion, GpuError, MemoryKind, MemoryRegistration};

/// Backend of [`MemoryKind::HostMemfd`]. Pool memory needs no registration.
pub struct HostMemfdBackend;

/// Backend of [`MemoryKind::HostProcess`]. Pool memory needs no registration.
pub struct HostProcessBackend;

impl crate::sealed::Sealed for HostMemfdBackend {}
impl crate::sealed::Sealed for HostProcessBackend {}

impl Backend for HostMemfdBackend {
    fn kind(&self) -> MemoryKind {
        MemoryKind::HostMemfd
    }

    fn open_region_for(
        &self,
        reg: &MemoryRegistration,
        fd: Option<OwnedFd>,
        _peer: &crate::Peer<'_>,
    ) -> Result<Box<dyn DeviceRegion>, GpuError> {
        expect_kind(MemoryKind::HostMemfd, reg)?;
        let fd = fd.ok_or_else(|| GpuError::invalid(MemoryKind::HostMemfd, "registration arrived without its memfd"))?;
        Ok(Box::new(MemfdRegion::open(reg, fd)?))
    }
}

impl Backend for HostProcessBackend {
    fn kind(&self) -> MemoryKind {
        MemoryKind::HostProcess
    }

    fn open_region_for(
        &self,
        reg: &MemoryRegistration,
        _fd: Option<OwnedFd>,
        peer: &crate::Peer<'_>,
    ) -> Result<Box<dyn DeviceRegion>, GpuError> {
        expect_kind(MemoryKind::HostProcess, reg)?;
        Ok(Box::new(ProcessRegion::open(reg, peer)?))
    }
}

/// A pidfd of `pid`, for opening a HostProcess region of a bare pid
/// ([`Backend::open_region`]).
pub(crate) fn pidfd_of(pid: u32) -> Result<OwnedFd, GpuError> {
    let raw = i32::try_from(pid)
        .ok()
        .and_then(Pid::from_raw)
        .ok_or_else(|| GpuError::invalid(MemoryKind::HostProcess, format!("peer pid {pid} is not a process id")))?;
    rustix::process::pidfd_open(raw, PidfdFlags::empty()).map_err(|e| match e {
        rustix::io::Errno::SRCH => GpuError::PeerGone { pid },
        e => GpuError::os("pidfd_open", e),
    })
}

/// `statfs` magic of hugetlbfs (MFD_HUGETLB memfds live there).
const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;

/// Checks that `fd` is a memfd sealed against shrinking and at least `offset + len` long.
/// Returns its seals.
fn check_memfd(fd: BorrowedFd<'_>, offset: u64, len: u64) -> Result<SealFlags, GpuError> {
    let kind = MemoryKind::HostMemfd;
    // F_GET_SEALS fails with EINVAL on anything but a memfd (or other sealable shmem file),
    // which is exactly the set of files whose size seals we can trust.
    let seals = rustix::fs::fcntl_get_seals(fd)
        .map_err(|e| GpuError::invalid(kind, format!("fd is not a memfd (F_GET_SEALS: {})", io::Error::from(e))))?;
    if !seals.contains(SealFlags::SHRINK) {
        return Err(GpuError::NotSealed { seals: seals.bits() });
    }
    // A hole punched in a hugetlb memfd (fallocate PUNCH_HOLE, allowed by every seal but
    // the write seals) unmaps its huge pages from the pool too and gives back their
    // reservation; the pool's next copy refaults them, and with the huge page pool empty
    // that fault is SIGBUS: the pool dies for every engine. Shmem memfds refault a zero
    // page instead. So hugetlb is taken only sealed against writes (loads then refused).
    let fs = rustix::fs::fstatfs(fd).map_err(|e| GpuError::os("fstatfs of memfd", e))?;
    if fs.f_type as i64 == HUGETLBFS_MAGIC && !seals.intersects(SealFlags::WRITE | SealFlags::FUTURE_WRITE) {
        return Err(GpuError::invalid(
            kind,
            "hugetlb memfd refused unless sealed with F_SEAL_WRITE (a punched hole would SIGBUS the pool); use a normal memfd",
        ));
    }
    if len == 0 {
        return Err(GpuError::invalid(kind, "size is 0"));
    }
    let end = offset.checked_add(len).ok_or_else(|| GpuError::invalid(kind, format!("offset {offset} + size {len} overflows")))?;
    let st = rustix::fs::fstat(fd).map_err(|e| GpuError::os("fstat of memfd", e))?;
    if end > st.st_size as u64 {
        return Err(GpuError::invalid(kind, format!("range {offset}..{end} passes the memfd's end at {}", st.st_size)));
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
        let map_len = usize::try_from(reg.offset - aligned + reg.size)
            .map_err(|_| GpuError::invalid(MemoryKind::HostMemfd, "size does not fit the address space"))?;
        let write_sealed = seals.intersects(SealFlags::WRITE | SealFlags::FUTURE_WRITE);
        let map_with = |prot: ProtFlags| {
            // SAFETY: a fresh shared mapping of a file whose size was checked above and
            // cannot shrink (F_SEAL_SHRINK), so every mapped page stays backed.
            unsafe { rustix::mm::mmap(std::ptr::null_mut(), map_len, prot, MapFlags::SHARED, &fd, aligned) }
        };
        let (map, writable) = if write_sealed {
            (map_with(ProtFlags::READ), false)
        } else {
            match map_with(ProtFlags::READ | ProtFlags::WRITE) {
                // The worker may have passed an fd opened read-only: serve stores at least.
                Err(rustix::io::Errno::ACCESS) | Err(rustix::io::Errno::PERM) => (map_with(ProtFlags::READ), false),
                other => (other, true),
            }
        };
        let map = map.map_err(|e| GpuError::os("mmap of memfd", e))?;
        let map = NonNull::new(map).ok_or_else(|| GpuError::os("mmap of memfd", io::Error::other("null mapping")))?;
        // SAFETY: offset - aligned < page <= map_len, inside the mapping.
        let data = unsafe { map.as_ptr().cast::<u8>().add((reg.offset - aligned) as usize) };
        Ok(Self { alloc_id: reg.alloc_id, map, map_len, data, len: reg.size, writable, fence_gpu: std::sync::OnceLock::new(), _fd: fd })
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

impl crate::sealed::RegionHooks for MemfdRegion {}

impl DeviceRegion for MemfdRegion {
    fn kind(&self) -> MemoryKind {
        MemoryKind::HostMemfd
    }

    fn fence_word(&self, slot: u32) -> Result<crate::FenceWord<'_>, GpuError> {
        use crate::fence::{MAX_FENCE_REGION_BYTES, SLOT_BYTES};
        let kind = MemoryKind::HostMemfd;
        if self.len > MAX_FENCE_REGION_BYTES {
            // The pool pins a fence page: a worker must not make it pin gigabytes.
            return Err(GpuError::invalid(
                kind,
                format!("{} bytes is too large for a fence page (at most {MAX_FENCE_REGION_BYTES})", self.len),
            ));
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
            return Err(GpuError::Unsupported("memfd region is read-only (write-sealed or opened read-only): cannot load into it".into()));
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
    /// `/proc/<pid>/mem`, opened at registration: bound to the address space the process
    /// had then (a later exec leaves it reading nothing), permission checked once.
    mem: OwnedFd,
    /// Becomes readable when the worker exits: a zero-length read is then `PeerGone`.
    pidfd: OwnedFd,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// Peer -> pool.
    Read,
    /// Pool -> peer.
    Write,
}

impl Direction {
    fn call(self) -> &'static str {
        match self {
            Direction::Read => "read of /proc/<pid>/mem",
            Direction::Write => "write of /proc/<pid>/mem",
        }
    }
}

impl ProcessRegion {
    fn open(reg: &MemoryRegistration, peer: &crate::Peer<'_>) -> Result<Self, GpuError> {
        let kind = MemoryKind::HostProcess;
        let peer_pid = peer.pid;
        let refused = |why: String| GpuError::invalid(kind, why);
        if reg.size == 0 {
            return Err(GpuError::invalid(kind, "size is 0"));
        }
        if reg.address == 0 || reg.address.checked_add(reg.size).is_none_or(|end| end > isize::MAX as u64) {
            return Err(GpuError::invalid(kind, format!("address {:#x} + size {} is not a user range", reg.address, reg.size)));
        }
        if peer_pid == 0 {
            return Err(refused(
                "peer is in another pid namespace (SO_PEERCRED pid 0): its process memory is out of reach; register a memfd".into(),
            ));
        }
        let pidfd = peer
            .pidfd
            .ok_or_else(|| refused(format!("no pidfd of peer {peer_pid}: it was gone at accept")))?
            .try_clone_to_owned()
            .map_err(|e| GpuError::os("dup of pidfd", e))?;
        // The pid is the process that connected, as that uid, both before the open (a clear
        // refusal) and after it (the open took whatever address space the pid had between
        // the two; if both checks pass, that is the peer's).
        (peer.verify)().map_err(refused)?;
        let path = format!("/proc/{peer_pid}/mem");
        let mem = rustix::fs::open(path.as_str(), rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC, rustix::fs::Mode::empty())
            .map_err(|e| match e {
                rustix::io::Errno::SRCH | rustix::io::Errno::NOENT => GpuError::PeerGone { pid: peer_pid },
                e => GpuError::PeerMemory {
                    op: "open of /proc/<pid>/mem",
                    pid: peer_pid,
                    address: reg.address,
                    len: reg.size,
                    source: e.into(),
                },
            })?;
        (peer.verify)().map_err(refused)?;
        let region = Self { alloc_id: reg.alloc_id, pid: peer_pid, address: reg.address, len: reg.size, mem, pidfd };
        // Touch both ends now so that a permission problem (Yama, non-dumpable worker) or a
        // bad address surfaces at registration, where the worker gets a readable refusal,
        // instead of at the first store.
        let mut probe = [0u8; 1];
        for at in [0, reg.size - 1] {
            let op = CopyOp { alloc_id: reg.alloc_id, device_offset: at, host_offset: 0, len: 1 };
            // SAFETY: `probe` is one writable byte and the op copies one byte to offset 0.
            unsafe { region.transfer(&[op], probe.as_mut_ptr(), Direction::Read) }?;
        }
        Ok(region)
    }

    fn check_alive(&self) -> Result<(), GpuError> {
        let mut fds = [rustix::event::PollFd::new(&self.pidfd, rustix::event::PollFlags::IN)];
        let zero = rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 };
        match rustix::event::poll(&mut fds, Some(&zero)) {
            Ok(0) => Ok(()),
            Ok(_) => Err(GpuError::PeerGone { pid: self.pid }),
            Err(e) => Err(GpuError::os("poll of pidfd", e)),
        }
    }

    /// Moves all ops, one pread/pwrite of the address space each, resuming short ones.
    ///
    /// # Safety
    /// `host[host_offset..+len]` is valid pool memory for each op, writable for reads.
    unsafe fn transfer(&self, ops: &[CopyOp], host: *mut u8, dir: Direction) -> Result<(), GpuError> {
        check_ops(ops, self.alloc_id, self.len)?;
        self.check_alive()?;
        for op in ops {
            let mut done = 0u64;
            while done < op.len {
                let remote = self.address + op.device_offset + done;
                let left = (op.len - done) as usize;
                // SAFETY: in bounds of pool memory by the caller's contract (check_ops
                // rules out overflow).
                let local = unsafe { host.add((op.host_offset + done) as usize) };
                // SAFETY: `local..+left` is valid pool memory (writable for reads) by the
                // caller's contract; the kernel checks the remote side against the address
                // space the file is bound to. remote <= isize::MAX (checked at open).
                let n = unsafe {
                    match dir {
                        Direction::Read => libc::pread64(self.mem.as_raw_fd(), local.cast(), left, remote as i64),
                        Direction::Write => libc::pwrite64(self.mem.as_raw_fd(), local.cast(), left, remote as i64),
                    }
                };
                let fail =
                    |source: io::Error| GpuError::PeerMemory { op: dir.call(), pid: self.pid, address: remote, len: left as u64, source };
                if n < 0 {
                    let err = io::Error::last_os_error();
                    return Err(match err.raw_os_error() {
                        Some(libc::ESRCH) => GpuError::PeerGone { pid: self.pid },
                        // The kernel reports an unmapped remote page as EIO.
                        Some(libc::EIO) => fail(io::Error::from_raw_os_error(libc::EFAULT)),
                        _ => fail(err),
                    });
                }
                if n == 0 {
                    // The address space the file is bound to is gone: the process exited
                    // or executed another program since it registered.
                    self.check_alive()?;
                    return Err(fail(io::Error::other("the process executed another program since it registered this memory")));
                }
                done += n as u64;
            }
        }
        Ok(())
    }
}

impl crate::sealed::RegionHooks for ProcessRegion {}

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

/// Worker side: lets the pool at `pool_pid` (its verified pid: SO_PEERCRED of the pool
/// socket, never a number from a message) read and write this process's memory, for
/// HostProcess registrations. Under Yama `ptrace_scope = 1` (the default of most
/// distributions) only ancestors may open a process's memory, and the pool is not the
/// worker's ancestor: `prctl(PR_SET_PTRACER, pool_pid)` names it as the one exception (the
/// worker used to say `PR_SET_PTRACER_ANY`, which let every process of its user in).
/// Without Yama the call fails with EINVAL, which means nothing is restricted and is
/// ignored. `pool_pid` 0 (the pool runs in a pid namespace this process cannot see) sets
/// nothing: under Yama such a pool cannot reach this process; use memfds.
pub fn allow_pool_ptrace(pool_pid: u32) -> Result<(), GpuError> {
    let Some(pid) = i32::try_from(pool_pid).ok().and_then(Pid::from_raw) else {
        return Ok(());
    };
    match rustix::process::set_ptracer(rustix::process::PTracer::ProcessID(pid)) {
        Ok(()) | Err(rustix::io::Errno::INVAL) => Ok(()),
        Err(e) => Err(GpuError::os("prctl(PR_SET_PTRACER, pool pid)", e)),
    }
}

/// Worker side: registration of `len` bytes at `ptr` of this process as HostProcess memory.
/// The worker must be dumpable (not setuid, no PR_SET_DUMPABLE 0), checked here; the
/// connection calls [`allow_pool_ptrace`] with the pool's verified pid before sending it.
pub fn export_process_memory(ptr: *const u8, len: usize, alloc_id: u32) -> Result<MemoryRegistration, GpuError> {
    let kind = MemoryKind::HostProcess;
    if ptr.is_null() || len == 0 {
        return Err(GpuError::invalid(kind, "null pointer or zero length"));
    }
    match rustix::process::dumpable_behavior() {
        Ok(rustix::process::DumpableBehavior::Dumpable) => {}
        Ok(_) => {
            return Err(GpuError::invalid(
                kind,
                "this process is not dumpable (PR_SET_DUMPABLE 0 or setuid): the pool cannot reach its memory",
            ))
        }
        Err(e) => return Err(GpuError::os("prctl(PR_GET_DUMPABLE)", e)),
    }
    Ok(new_registration(kind, alloc_id, ptr as u64, 0, len as u64))
}

/// Worker side: registration of `len` bytes at `offset` of memfd `fd` as HostMemfd memory.
/// The fd itself travels beside the message (SCM_RIGHTS). Refuses, as the pool would, an fd
/// that is not a memfd sealed with F_SEAL_SHRINK or is shorter than `offset + len`.
pub fn export_memfd(fd: BorrowedFd<'_>, offset: u64, len: u64, alloc_id: u32) -> Result<MemoryRegistration, GpuError> {
    check_memfd(fd, offset, len)?;
    Ok(new_registration(MemoryKind::HostMemfd, alloc_id, 0, offset, len))
}
