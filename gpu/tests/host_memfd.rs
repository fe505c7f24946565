//! HostMemfd backend against real memfds: sealing rules, both copy directions, bounds.

mod common;

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;

use common::{check, fill, pattern, PoolMem};
use memfd::{FileSeal, MemfdOptions};
use umbp_gpu::host::export_memfd;
use umbp_gpu::{backend_for, CopyOp, DeviceRegion, GpuError, MemoryKind};

const FILE_LEN: u64 = 1 << 20;
/// Not page aligned, so the mapping offset rounding is exercised.
const REG_OFFSET: u64 = 4096 + 100;
const REG_LEN: u64 = 512 * 1024;

fn memfd(seals: &[FileSeal]) -> File {
    let mfd = MemfdOptions::default().allow_sealing(true).create("umbp-gpu-test").unwrap();
    mfd.as_file().set_len(FILE_LEN).unwrap();
    let mut content = vec![0u8; FILE_LEN as usize];
    fill(&mut content, 1);
    mfd.as_file().write_all_at(&content, 0).unwrap();
    for &s in seals {
        mfd.add_seal(s).unwrap();
    }
    mfd.into_file()
}

fn open(file: &File) -> Result<Box<dyn DeviceRegion>, GpuError> {
    let reg = export_memfd(file.as_fd(), REG_OFFSET, REG_LEN, 5)?;
    let fd: OwnedFd = file.try_clone().unwrap().into();
    backend_for(MemoryKind::HostMemfd)?.open_region(&reg, Some(fd), 0)
}

fn op(device_offset: u64, host_offset: u64, len: u64) -> CopyOp {
    CopyOp { alloc_id: 5, device_offset, host_offset, len }
}

#[test]
fn copies_both_ways() {
    let file = memfd(&[FileSeal::SealShrink, FileSeal::SealGrow, FileSeal::SealSeal]);
    let region = open(&file).unwrap();
    assert_eq!(region.kind(), MemoryKind::HostMemfd);
    assert_eq!(region.len(), REG_LEN);

    // Store direction: scattered pages, in reverse order on the host side.
    let page = 4096u64;
    let pages = REG_LEN / page;
    let ops: Vec<CopyOp> = (0..pages).map(|p| op(p * page, (pages - 1 - p) * page, page)).collect();
    let mut host = PoolMem::new(REG_LEN as usize);
    // SAFETY: every op's host range lies inside `host`.
    unsafe { region.copy_to_host(&ops, host.ptr()) }.unwrap();
    for p in 0..pages {
        for i in 0..page {
            let file_at = (REG_OFFSET + p * page + i) as usize;
            assert_eq!(host.bytes()[((pages - 1 - p) * page + i) as usize], pattern(1, file_at), "page {p} byte {i}");
        }
    }

    // Load direction: the whole range in one op, then read the file to compare.
    fill(host.bytes_mut(), 9);
    // SAFETY: the op's host range is `host`.
    unsafe { region.copy_from_host(&[op(0, 0, REG_LEN)], host.ptr()) }.unwrap();
    let mut back = vec![0u8; REG_LEN as usize];
    file.read_exact_at(&mut back, REG_OFFSET).unwrap();
    assert_eq!(check(&back, 9), "OK");
    // Bytes around the registered range are untouched.
    let mut before = [0u8; 100];
    file.read_exact_at(&mut before, REG_OFFSET - 100).unwrap();
    assert!(before.iter().enumerate().all(|(i, &b)| b == pattern(1, (REG_OFFSET - 100) as usize + i)));
}

#[test]
fn out_of_range_op_is_refused_and_nothing_moves() {
    let file = memfd(&[FileSeal::SealShrink]);
    let region = open(&file).unwrap();
    let mut host = PoolMem::new(8192);
    fill(host.bytes_mut(), 3);
    let ops = [op(0, 0, 4096), op(REG_LEN - 10, 4096, 11)];
    // SAFETY: host ranges lie inside `host`.
    let err = unsafe { region.copy_to_host(&ops, host.ptr()) }.unwrap_err();
    assert!(matches!(err, GpuError::OutOfRange { index: 1, .. }), "{err}");
    assert_eq!(check(host.bytes(), 3), "OK", "a refused batch copies nothing, not even its valid ops");
    // SAFETY: as above.
    let err = unsafe { region.copy_from_host(&[op(u64::MAX - 5, 0, 10)], host.ptr()) }.unwrap_err();
    assert!(matches!(err, GpuError::OutOfRange { .. }), "{err}");
    // SAFETY: as above.
    let err = unsafe { region.copy_from_host(&[CopyOp { alloc_id: 6, ..op(0, 0, 1) }], host.ptr()) }.unwrap_err();
    assert!(matches!(err, GpuError::WrongAllocation { .. }), "{err}");
}

#[test]
fn unsealed_memfd_is_refused() {
    let file = memfd(&[FileSeal::SealGrow]);
    // Worker side refuses...
    let err = export_memfd(file.as_fd(), 0, 4096, 1).unwrap_err();
    assert!(matches!(err, GpuError::NotSealed { .. }), "{err}");
    assert!(err.to_string().contains("F_SEAL_SHRINK"), "{err}");
    // ...and so does the pool, which cannot trust the worker to have checked.
    let mut reg = export_memfd(memfd(&[FileSeal::SealShrink]).as_fd(), 0, 4096, 1).unwrap();
    reg.alloc_id = 1;
    let err = backend_for(MemoryKind::HostMemfd).unwrap().open_region(&reg, Some(file.into()), 0).err().unwrap();
    assert!(matches!(err, GpuError::NotSealed { .. }), "{err}");
}

#[test]
fn other_files_and_bad_ranges_are_refused() {
    let backend = backend_for(MemoryKind::HostMemfd).unwrap();
    let reg = export_memfd(memfd(&[FileSeal::SealShrink]).as_fd(), 0, 4096, 1).unwrap();

    let tmp = regular_tempfile();
    let err = backend.open_region(&reg, Some(tmp.into()), 0).err().unwrap();
    assert!(err.to_string().contains("not a memfd"), "{err}");

    let err = backend.open_region(&reg, None, 0).err().unwrap();
    assert!(err.to_string().contains("without its memfd"), "{err}");

    let sealed = memfd(&[FileSeal::SealShrink]);
    let err = export_memfd(sealed.as_fd(), FILE_LEN - 10, 11, 1).unwrap_err();
    assert!(err.to_string().contains("passes the memfd's end"), "{err}");
    let mut past_end = reg;
    past_end.offset = FILE_LEN;
    let err = backend.open_region(&past_end, Some(sealed.into()), 0).err().unwrap();
    assert!(err.to_string().contains("passes the memfd's end"), "{err}");

    let mut wrong_kind = reg;
    wrong_kind.kind = MemoryKind::HostProcess as u32;
    let err = backend.open_region(&wrong_kind, Some(memfd(&[FileSeal::SealShrink]).into()), 0).err().unwrap();
    assert!(matches!(err, GpuError::KindMismatch { .. }), "{err}");
}

#[test]
fn write_sealed_memfd_serves_stores_only() {
    let file = memfd(&[FileSeal::SealShrink, FileSeal::SealWrite]);
    let region = open(&file).unwrap();
    let host = PoolMem::new(4096);
    // SAFETY: host range inside `host`.
    unsafe { region.copy_to_host(&[op(0, 0, 4096)], host.ptr()) }.unwrap();
    assert_eq!(host.bytes()[0], pattern(1, REG_OFFSET as usize));
    // SAFETY: as above.
    let err = unsafe { region.copy_from_host(&[op(0, 0, 4096)], host.ptr()) }.unwrap_err();
    assert!(err.to_string().contains("read-only"), "{err}");
}

/// A regular file (not a memfd), already unlinked.
fn regular_tempfile() -> File {
    let dir = std::env::temp_dir();
    let path = dir.join(format!("umbp-gpu-test-{}", std::process::id()));
    let f = File::options().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
    f.set_len(8192).unwrap();
    std::fs::remove_file(&path).unwrap();
    f
}
