//! HostProcess backend against a real second process: the test binary re-executes itself
//! as the "worker", which exports a buffer with a known pattern; the test copies from it
//! and into it (the worker verifies), then kills it and expects errors, not crashes.

mod common;

use common::{check, fill, is_child, pattern, reg_from_hex, reg_to_hex, serve, Peer, PoolMem};
use umbp_gpu::host::export_process_memory;
use umbp_gpu::{backend_for, CopyOp, DeviceRegion, GpuError, MemoryKind, MemoryRegistration};

/// Not a multiple of the page size, and large enough for more than IOV_MAX small ops.
const BUF_LEN: usize = 3 * 1024 * 1024 + 123;

/// The worker process: allocates and exports a buffer, plus a range with an unmapped page
/// in the middle, then answers `verify` commands.
#[test]
fn peer_child_entry() {
    if !is_child() {
        return;
    }
    let mut buf = vec![0u8; BUF_LEN];
    fill(&mut buf, 1);
    let reg = export_process_memory(buf.as_ptr(), buf.len(), 11).unwrap();
    println!("REG {}", reg_to_hex(&reg));

    // Three pages with the middle one unmapped: its ends are readable, its middle is not.
    let page = 4096;
    // SAFETY: a fresh anonymous mapping, then part of it unmapped; never accessed here.
    let holed = unsafe {
        let p =
            libc::mmap(std::ptr::null_mut(), 3 * page, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
        assert_ne!(p, libc::MAP_FAILED);
        assert_eq!(libc::munmap(p.cast::<u8>().add(page).cast(), page), 0);
        p as usize
    };
    let reg = export_process_memory(holed as *const u8, 3 * page, 12).unwrap();
    println!("HOLED {}", reg_to_hex(&reg));

    serve(|seed| {
        // SAFETY: volatile reads because the pool process wrote `buf` behind the compiler's
        // back (process_vm_writev); plain reads could be reordered before the command.
        let snapshot: Vec<u8> = (0..buf.len()).map(|i| unsafe { std::ptr::read_volatile(buf.as_ptr().add(i)) }).collect();
        check(&snapshot, seed)
    });
}

fn op(device_offset: u64, host_offset: u64, len: u64) -> CopyOp {
    CopyOp { alloc_id: 11, device_offset, host_offset, len }
}

fn open(reg: &MemoryRegistration, pid: u32) -> Result<Box<dyn DeviceRegion>, GpuError> {
    backend_for(MemoryKind::HostProcess).unwrap().open_region(reg, None, pid)
}

#[test]
fn copies_to_and_from_a_live_process() {
    let mut peer = Peer::spawn("peer_child_entry");
    let reg = reg_from_hex(&peer.expect("REG"));
    assert_eq!(reg.size, BUF_LEN as u64);
    let region = open(&reg, peer.pid()).unwrap();
    assert_eq!(region.kind(), MemoryKind::HostProcess);

    // Store direction, many small ops (more than one iovec batch), host side permuted.
    let piece = 1000u64;
    let n = BUF_LEN as u64 / piece;
    assert!(n > 2 * 1024, "must span several IOV_MAX batches");
    let ops: Vec<CopyOp> = (0..n).map(|i| op(i * piece, (n - 1 - i) * piece, piece)).collect();
    let host = PoolMem::new(BUF_LEN);
    // SAFETY: all host ranges lie inside `host`.
    unsafe { region.copy_to_host(&ops, host.ptr()) }.unwrap();
    for i in 0..n as usize {
        let src = i * piece as usize;
        let dst = (n as usize - 1 - i) * piece as usize;
        assert_eq!(
            host.bytes()[dst..dst + piece as usize],
            (src..src + piece as usize).map(|j| pattern(1, j)).collect::<Vec<_>>()[..],
            "op {i}"
        );
    }

    // One op for the whole buffer.
    let mut whole = PoolMem::new(BUF_LEN);
    // SAFETY: the host range is `whole`.
    unsafe { region.copy_to_host(&[op(0, 0, BUF_LEN as u64)], whole.ptr()) }.unwrap();
    assert_eq!(check(whole.bytes(), 1), "OK");

    // Load direction in 1500 uneven pieces; the worker checks its buffer.
    fill(whole.bytes_mut(), 2);
    let mut ops = Vec::new();
    let mut at = 0u64;
    let mut len = 1u64;
    while at < BUF_LEN as u64 {
        let l = len.min(BUF_LEN as u64 - at);
        ops.push(op(at, at, l));
        at += l;
        len = len * 7 % 4099 + 1;
    }
    assert!(ops.len() > 1024);
    // SAFETY: host ranges lie inside `whole`.
    unsafe { region.copy_from_host(&ops, whole.ptr()) }.unwrap();
    assert_eq!(peer.verify(2), "OK");

    // A bad op refuses the batch before any byte moves.
    fill(whole.bytes_mut(), 3);
    // SAFETY: host ranges lie inside `whole`.
    let err = unsafe { region.copy_from_host(&[op(0, 0, 10), op(BUF_LEN as u64 - 1, 0, 2)], whole.ptr()) }.unwrap_err();
    assert!(matches!(err, GpuError::OutOfRange { index: 1, .. }), "{err}");
    assert_eq!(peer.verify(2), "OK");

    // The worker dies: copies fail with an error naming it, in both directions.
    let pid = peer.pid();
    peer.child.kill().unwrap();
    peer.child.wait().unwrap();
    // SAFETY: host range inside `whole`.
    let err = unsafe { region.copy_to_host(&[op(0, 0, 4096)], whole.ptr()) }.unwrap_err();
    assert!(matches!(err, GpuError::PeerGone { pid: p } if p == pid), "{err}");
    // SAFETY: as above.
    let err = unsafe { region.copy_from_host(&[op(0, 0, 4096)], whole.ptr()) }.unwrap_err();
    assert!(matches!(err, GpuError::PeerGone { .. }), "{err}");
    // Opening against a dead pid fails too.
    let err = open(&reg, pid).err().unwrap();
    assert!(matches!(err, GpuError::PeerGone { .. }), "{err}");
}

#[test]
fn unmapped_peer_memory_is_an_error() {
    let mut peer = Peer::spawn("peer_child_entry");
    let reg = reg_from_hex(&peer.expect("REG"));
    let holed = reg_from_hex(&peer.expect("HOLED"));

    // A registration running past the end of the worker's mapping is refused at open,
    // where the worker can be told.
    let mut too_long = reg;
    too_long.size = 1 << 40;
    let err = open(&too_long, peer.pid()).err().unwrap();
    assert!(matches!(err, GpuError::PeerMemory { source: ref s, .. } if s.raw_os_error() == Some(libc::EFAULT)), "{err}");

    // Ends mapped, middle not: opens, and a copy across the hole stops there with an error
    // naming the first unmapped address (the first page arrives, as a partial transfer).
    let region = open(&holed, peer.pid()).unwrap();
    let mut host = PoolMem::new(3 * 4096);
    fill(host.bytes_mut(), 4);
    let ops = [CopyOp { alloc_id: 12, device_offset: 0, host_offset: 0, len: 3 * 4096 }];
    // SAFETY: the host range is `host`.
    let err = unsafe { region.copy_to_host(&ops, host.ptr()) }.unwrap_err();
    match &err {
        GpuError::PeerMemory { address, source, .. } => {
            assert_eq!(*address, holed.address + 4096, "{err}");
            assert_eq!(source.raw_os_error(), Some(libc::EFAULT), "{err}");
        }
        _ => panic!("unexpected {err}"),
    }
    // Two separate ops: the first succeeds, the second faults.
    let ops = [
        CopyOp { alloc_id: 12, device_offset: 0, host_offset: 0, len: 100 },
        CopyOp { alloc_id: 12, device_offset: 4096 + 8, host_offset: 100, len: 100 },
    ];
    // SAFETY: host ranges inside `host`.
    let err = unsafe { region.copy_from_host(&ops, host.ptr()) }.unwrap_err();
    assert!(matches!(err, GpuError::PeerMemory { address, .. } if address == holed.address + 4096 + 8), "{err}");

    // A pid that is not a process.
    let err = open(&reg, 0).err().unwrap();
    assert!(err.to_string().contains("not a process id"), "{err}");
}
