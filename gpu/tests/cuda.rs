//! CUDA backend. Without libcuda (CI, developer machines) the real test prints why it is
//! skipped and only the error path is checked; on a GPU machine a second process allocates
//! device memory, exports it over IPC and the test copies through the pool backend.

mod common;

use common::{
    assert_copied_to_host, check, check_missing_library_is_named, ck, cuda_or_skip, fill, is_child, op_from_start, pattern, reg_from_hex,
    reg_to_hex, retain_primary_context, reversed_pages, serve, Peer, PoolMem,
};
use umbp_gpu::cuda::{self, sys};
use umbp_gpu::{CopyOp, GpuError, MemoryKind};

/// Bytes the worker registers: over the engine's split size, not a page multiple.
const LEN: usize = (40 << 20) + 12_345;
/// Where the registered range starts inside the worker's allocation.
const OFFSET: u64 = 4096 * 3;

#[test]
fn missing_cuda_is_a_clear_error() {
    check_missing_library_is_named("libcuda", cuda::init(), MemoryKind::Cuda, cuda::export_cuda_memory);
}

/// The worker: owns a device allocation with pattern 1 and verifies on request.
#[test]
fn cuda_child_entry() {
    if !is_child() {
        return;
    }
    cuda::init().unwrap();
    let alloc = LEN + 2 * OFFSET as usize;
    let mut dptr: sys::CUdeviceptr = 0;
    let mut host = vec![0u8; LEN];
    fill(&mut host, 1);
    // SAFETY: plain driver calls on locals; the context stays current on this thread.
    unsafe {
        ck("cuCtxSetCurrent", sys::cuCtxSetCurrent(retain_primary_context()));
        ck("cuMemAlloc", sys::cuMemAlloc_v2(&mut dptr, alloc));
        ck("cuMemsetD8", sys::cuMemsetD8_v2(dptr, 0xee, alloc));
        ck("cuMemcpyHtoD", sys::cuMemcpyHtoD_v2(dptr + OFFSET, host.as_ptr().cast(), LEN));
        // The memset and the pageable copy may still run when their calls return; the
        // other process reads this memory next, ordered by nothing else.
        ck("cuCtxSynchronize", sys::cuCtxSynchronize());
    }
    let reg = cuda::export_cuda_memory(dptr + OFFSET, LEN as u64, 21).unwrap();
    assert_eq!(reg.offset, OFFSET);
    println!("REG {}", reg_to_hex(&reg));
    serve(|seed| {
        // SAFETY: copies the registered range into `host`, which has LEN bytes.
        unsafe { ck("cuMemcpyDtoH", sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), dptr + OFFSET, LEN)) };
        check(&host, seed)
    });
}

#[test]
fn cuda_ipc_roundtrip() {
    if is_child() {
        return;
    }
    let Some(backend) = cuda_or_skip() else {
        return;
    };
    let mut peer = Peer::spawn("cuda_child_entry");
    let reg = reg_from_hex(&peer.expect("REG"));
    assert_eq!(reg.kind, MemoryKind::Cuda as u32);

    // Pool memory in two registered chunks, as the pool's background registration does.
    let mut pool = PoolMem::new(2 * LEN);
    // SAFETY: both chunks lie inside `pool`, which outlives the registrations.
    unsafe {
        backend.register_host_memory(pool.ptr(), LEN).unwrap();
        backend.register_host_memory(pool.ptr().add(LEN), LEN).unwrap();
    }
    let region = backend.open_region(&reg, None, peer.pid()).unwrap();
    assert_eq!(region.len(), LEN as u64);

    // A second registration inside the same allocation shares the IPC mapping.
    let mut sub = reg;
    sub.alloc_id = 22;
    sub.offset = OFFSET + 4096;
    sub.size = 4096;
    let sub_region = backend.open_region(&sub, None, peer.pid()).unwrap();

    // Store: 64 KiB pages, reversed, into the second chunk.
    let ops = reversed_pages(21, LEN as u64, LEN as u64);
    // SAFETY: every host range lies in the second chunk of `pool`.
    unsafe { region.copy_to_host(&ops, pool.ptr()) }.unwrap();
    assert_copied_to_host(pool.bytes(), &ops, 1);

    // The sub-range sees bytes 4096.. of the registered range, and keeps working after
    // the other region is dropped (the shared mapping is reference counted).
    drop(region);
    // SAFETY: host range inside `pool`.
    unsafe { sub_region.copy_to_host(&[op_from_start(22, 4096)], pool.ptr()) }.unwrap();
    assert!((0..4096).all(|i| pool.bytes()[i] == pattern(1, 4096 + i)));
    let region = backend.open_region(&reg, None, peer.pid()).unwrap();

    // Load: the whole range as one op (split across streams inside), then the worker checks.
    fill(&mut pool.bytes_mut()[..LEN], 2);
    // SAFETY: the host range is the first chunk.
    unsafe { region.copy_from_host(&[op_from_start(21, LEN as u64)], pool.ptr()) }.unwrap();
    assert_eq!(peer.verify(2), "OK");

    // Out of range: refused before any byte moves.
    // SAFETY: host ranges inside `pool`.
    let err =
        unsafe { region.copy_from_host(&[CopyOp { alloc_id: 21, device_offset: LEN as u64 - 1, host_offset: 0, len: 2 }], pool.ptr()) }
            .unwrap_err();
    assert!(matches!(err, GpuError::OutOfRange { .. }), "{err}");
    assert_eq!(peer.verify(2), "OK");

    // A registration past the end of the exported allocation is refused at open.
    let mut too_long = reg;
    too_long.size = 1 << 40;
    let err = backend.open_region(&too_long, None, peer.pid()).err().unwrap();
    assert!(err.to_string().contains("passes the exported allocation"), "{err}");

    // An unknown device UUID names the cause.
    let mut elsewhere = reg;
    elsewhere.device_uuid = [0xab; 16];
    let err = backend.open_region(&elsewhere, None, peer.pid()).err().unwrap();
    assert!(matches!(err, GpuError::DeviceNotFound { .. }), "{err}");

    drop(region);
    drop(sub_region);
    // SAFETY: no copy is in flight; both chunks were registered above.
    unsafe {
        backend.unregister_host_memory(pool.ptr()).unwrap();
        backend.unregister_host_memory(pool.ptr().add(LEN)).unwrap();
    }
    peer.send("exit");
}

/// Embedded mode: the pool runs inside the worker, which cannot open its own IPC handle;
/// the backend then uses the device pointer directly.
#[test]
fn cuda_in_process_region() {
    if is_child() {
        return;
    }
    let Some(backend) = cuda_or_skip() else {
        return;
    };
    let len = 1 << 20;
    let mut dptr: sys::CUdeviceptr = 0;
    let mut host = vec![0u8; len];
    fill(&mut host, 5);
    // SAFETY: plain driver calls on locals; the primary context is pushed and popped.
    unsafe {
        ck("cuCtxPushCurrent", sys::cuCtxPushCurrent_v2(retain_primary_context()));
        ck("cuMemAlloc", sys::cuMemAlloc_v2(&mut dptr, len + 4096));
        ck("cuMemcpyHtoD", sys::cuMemcpyHtoD_v2(dptr + 4096, host.as_ptr().cast(), len));
        // A pageable copy may still run when the call returns; the engine's streams do
        // not wait for the legacy stream.
        ck("cuCtxSynchronize", sys::cuCtxSynchronize());
    }
    let reg = cuda::export_cuda_memory(dptr + 4096, len as u64, 3).unwrap();
    let region = backend.open_region(&reg, None, std::process::id()).unwrap();
    let out = PoolMem::new(len);
    // SAFETY: the host range is `out`.
    unsafe { region.copy_to_host(&[op_from_start(3, len as u64)], out.ptr()) }.unwrap();
    assert_eq!(check(out.bytes(), 5), "OK");
    // A stale address (offset not matching the allocation) is refused.
    let mut shifted = reg;
    shifted.offset += 8;
    assert!(backend.open_region(&shifted, None, std::process::id()).is_err());
    drop(region);
    // SAFETY: the allocation is unused now.
    unsafe { ck("cuMemFree", sys::cuMemFree_v2(dptr)) };
}
