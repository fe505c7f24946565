//! Shared memory as sealed memfds: no names in /dev/shm, nothing to clean up after a crash,
//! and no peer can shrink a region under another and make it SIGBUS.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use memfd::{FileSeal, MemfdOptions};
use rustix::mm::{mmap, munmap, MapFlags, ProtFlags};

#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    #[error("memfd_create({name}) failed: {source}")]
    Create { name: String, source: std::io::Error },
    #[error("sizing memfd {name} to {len} bytes failed: {source}")]
    Size { name: String, len: usize, source: std::io::Error },
    #[error("mmap of {len} bytes failed: {source}")]
    Map { len: usize, source: std::io::Error },
    #[error("sealing memfd failed: {0}")]
    Seal(std::io::Error),
    #[error("received fd is not a sealed memfd (F_GET_SEALS: {0}); refusing to map it")]
    SealsUnreadable(#[source] std::io::Error),
    #[error("received memfd's seals {0:?} lack F_SEAL_SHRINK; refusing to map it")]
    NotSealed(rustix::fs::SealFlags),
    #[error("fstat of the received memfd failed: {0}")]
    Stat(#[source] std::io::Error),
    #[error("received region is {actual} bytes, expected at least {expected}")]
    TooSmall { actual: u64, expected: u64 },
}

/// A mapped memfd. Unmapped on drop; the fd stays open for as long as this lives.
pub struct SharedMemory {
    fd: OwnedFd,
    ptr: NonNull<u8>,
    len: usize,
    writable: bool,
}

// SAFETY: the mapping is plain shared memory; synchronisation is the users' protocol.
unsafe impl Send for SharedMemory {}
// SAFETY: as above.
unsafe impl Sync for SharedMemory {}

/// Seals every region gets before it is shared: its size is fixed for good.
const SIZE_SEALS: [FileSeal; 2] = [FileSeal::SealShrink, FileSeal::SealGrow];

impl SharedMemory {
    /// Creates, sizes and maps a zeroed memfd, then seals its size.
    pub fn create(name: &str, len: usize, hugepages: bool) -> Result<Self, ShmError> {
        let mut opts = MemfdOptions::new().allow_sealing(true).close_on_exec(true);
        if hugepages {
            opts = opts.hugetlb(Some(memfd::HugetlbSize::Huge2MB));
        }
        let mfd = opts.create(name).map_err(|e| ShmError::Create { name: name.to_string(), source: std::io::Error::other(e) })?;
        mfd.as_file().set_len(len as u64).map_err(|source| ShmError::Size { name: name.to_string(), len, source })?;
        let map = Self::map_fd(mfd.as_file().as_fd(), len, true)?;
        mfd.add_seals(&SIZE_SEALS).map_err(|e| ShmError::Seal(std::io::Error::other(e)))?;
        let fd: OwnedFd = mfd.into_file().into();
        Ok(Self { fd, ptr: map, len, writable: true })
    }

    fn map_fd(fd: BorrowedFd<'_>, len: usize, writable: bool) -> Result<NonNull<u8>, ShmError> {
        let prot = if writable { ProtFlags::READ | ProtFlags::WRITE } else { ProtFlags::READ };
        // SAFETY: a fresh mapping chosen by the kernel; nothing else is at that address.
        let p = unsafe { mmap(std::ptr::null_mut(), len, prot, MapFlags::SHARED, fd, 0) }
            .map_err(|e| ShmError::Map { len, source: e.into() })?;
        Ok(NonNull::new(p as *mut u8).expect("mmap never returns null on success"))
    }

    /// Adds the final seals: no more writable mappings by anyone (the existing writable one
    /// stays; this is how the index is shared read-only), and no further seal changes.
    pub fn seal_read_only(&self) -> Result<(), ShmError> {
        let seals = rustix::fs::SealFlags::FUTURE_WRITE | rustix::fs::SealFlags::SEAL;
        rustix::fs::fcntl_add_seals(&self.fd, seals).map_err(|e| ShmError::Seal(e.into()))
    }

    /// Forbids further seal changes (regions that stay writable for the peer).
    pub fn seal_final(&self) -> Result<(), ShmError> {
        rustix::fs::fcntl_add_seals(&self.fd, rustix::fs::SealFlags::SEAL).map_err(|e| ShmError::Seal(e.into()))
    }

    /// Maps a memfd received from a peer after checking that its size is sealed and large
    /// enough. A writable mapping of a FUTURE_WRITE-sealed fd fails with EPERM.
    pub fn from_received(fd: OwnedFd, min_len: usize, writable: bool) -> Result<Self, ShmError> {
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|e| ShmError::SealsUnreadable(e.into()))?;
        if !seals.contains(rustix::fs::SealFlags::SHRINK) {
            return Err(ShmError::NotSealed(seals));
        }
        let size = rustix::fs::fstat(&fd).map_err(|e| ShmError::Stat(e.into()))?.st_size as u64;
        if size < min_len as u64 {
            return Err(ShmError::TooSmall { actual: size, expected: min_len as u64 });
        }
        let ptr = Self::map_fd(fd.as_fd(), size as usize, writable)?;
        Ok(Self { fd, ptr, len: size as usize, writable })
    }

    /// Maps every page of the mapping now (MADV_POPULATE_READ, Linux 5.14+), so later
    /// reads never take a page fault: for latency-critical readers such as a scheduler's
    /// index lookups. Returns false where the kernel cannot (pages then fault in on first
    /// read, as without this call).
    pub fn populate_read(&self) -> bool {
        // SAFETY: advice over exactly this mapping; it changes no contents.
        unsafe { rustix::mm::madvise(self.ptr.as_ptr().cast(), self.len, rustix::mm::Advice::LinuxPopulateRead) }.is_ok()
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn is_writable(&self) -> bool {
        self.writable
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub fn raw_fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        // SAFETY: we own this mapping; users borrow from `self`, so none outlive it.
        let _ = unsafe { munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn populate_keeps_contents() {
        let shm = SharedMemory::create("umbp-test", 1 << 20, false).unwrap();
        // SAFETY: inside the mapping.
        unsafe { shm.as_ptr().add(5000).write(7) };
        let ro = SharedMemory::from_received(shm.fd().try_clone_to_owned().unwrap(), 1 << 20, false).unwrap();
        // Kernels before 5.14 say no; the mapping works either way.
        let _ = ro.populate_read();
        // SAFETY: inside the mapping.
        let (first, last) = unsafe { (ro.as_ptr().add(5000).read(), ro.as_ptr().add((1 << 20) - 1).read()) };
        assert_eq!((first, last), (7, 0));
    }

    #[test]
    fn create_seal_and_remap() {
        let shm = SharedMemory::create("umbp-test", 1 << 16, false).unwrap();
        // SAFETY: inside the mapping.
        unsafe { shm.as_ptr().add(100).write(42) };
        shm.seal_read_only().unwrap();
        let dup = shm.fd().try_clone_to_owned().unwrap();
        assert!(matches!(SharedMemory::from_received(dup.try_clone().unwrap(), 1 << 16, true), Err(ShmError::Map { .. })));
        let ro = SharedMemory::from_received(dup, 1 << 16, false).unwrap();
        // SAFETY: inside the mapping.
        assert_eq!(unsafe { ro.as_ptr().add(100).read() }, 42);
        // The original writable mapping still works (the pool keeps writing the index).
        // SAFETY: inside the mapping.
        unsafe { shm.as_ptr().add(101).write(7) };
        // SAFETY: inside the mapping.
        assert_eq!(unsafe { ro.as_ptr().add(101).read() }, 7);
    }

    #[test]
    fn unsealed_or_short_fds_are_refused() {
        let plain = memfd::MemfdOptions::new().create("plain").unwrap();
        plain.as_file().set_len(4096).unwrap();
        let fd: OwnedFd = plain.into_file().into();
        assert!(matches!(SharedMemory::from_received(fd, 4096, false), Err(ShmError::NotSealed(_))));
        let shm = SharedMemory::create("short", 4096, false).unwrap();
        let dup = shm.fd().try_clone_to_owned().unwrap();
        assert!(matches!(SharedMemory::from_received(dup, 8192, false), Err(ShmError::TooSmall { .. })));
    }
}
