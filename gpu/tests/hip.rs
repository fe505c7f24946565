//! HIP backend. NEVER RUN ON AMD HARDWARE so far: without libamdhip64 (every machine this
//! project has used) only the error path runs and the device test prints why it skipped.
//! The device test mirrors `cuda.rs` and is meant for the first MI-series run.

mod common;

use std::ffi::c_void;
use std::sync::Arc;

use common::{
    assert_copied_to_host, check, check_missing_library_is_named, fill, is_child, op_from_start, reg_from_hex, reg_to_hex, reversed_pages,
    serve, Peer, PoolMem,
};
use umbp_gpu::{backend_for, hip, Backend, MemoryKind};

const LEN: usize = (40 << 20) + 12_345;
const OFFSET: u64 = 4096 * 3;

fn hip_or_skip() -> Option<Arc<dyn Backend>> {
    let backend = match backend_for(MemoryKind::Hip) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("SKIPPED: no usable HIP runtime: {e}");
            return None;
        }
    };
    match hip::device_count() {
        Ok(n) if n > 0 => Some(backend),
        other => {
            eprintln!("SKIPPED: HIP loaded but no device ({other:?})");
            None
        }
    }
}

#[test]
fn missing_hip_is_a_clear_error() {
    check_missing_library_is_named("libamdhip64", hip::init(), MemoryKind::Hip, hip::export_hip_memory);
}

type HipMalloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> i32;
type HipMemcpy = unsafe extern "C" fn(*mut c_void, *const c_void, usize, i32) -> i32;

/// The worker: hipMalloc'd memory with pattern 1, verified on request.
#[test]
fn hip_child_entry() {
    if !is_child() {
        return;
    }
    hip::init().unwrap();
    // SAFETY: loading the runtime the backend already loaded; the prototypes match the
    // HIP headers (hipMemcpyKind is a C enum: 1 = HostToDevice, 2 = DeviceToHost).
    let (lib, malloc, memcpy) = unsafe {
        let lib = libloading::Library::new("libamdhip64.so").unwrap();
        let malloc: HipMalloc = *lib.get(b"hipMalloc\0").unwrap();
        let memcpy: HipMemcpy = *lib.get(b"hipMemcpy\0").unwrap();
        (lib, malloc, memcpy)
    };
    let mut dptr: *mut c_void = std::ptr::null_mut();
    let mut host = vec![0u8; LEN];
    fill(&mut host, 1);
    // SAFETY: allocation and a copy into it, within its size.
    unsafe {
        assert_eq!(malloc(&mut dptr, LEN + 2 * OFFSET as usize), 0, "hipMalloc");
        assert_eq!(memcpy(dptr.cast::<u8>().add(OFFSET as usize).cast(), host.as_ptr().cast(), LEN, 1), 0, "hipMemcpy");
    }
    let ptr = dptr as u64 + OFFSET;
    let reg = hip::export_hip_memory(ptr, LEN as u64, 31).unwrap();
    assert_eq!(reg.offset, OFFSET);
    println!("REG {}", reg_to_hex(&reg));
    serve(|seed| {
        // SAFETY: copies the registered range into `host`, which has LEN bytes.
        let r = unsafe { memcpy(host.as_mut_ptr().cast(), ptr as *const c_void, LEN, 2) };
        assert_eq!(r, 0, "hipMemcpy");
        check(&host, seed)
    });
    drop(lib);
}

#[test]
fn hip_ipc_roundtrip() {
    if is_child() {
        return;
    }
    let Some(backend) = hip_or_skip() else { return };
    let mut peer = Peer::spawn("hip_child_entry");
    let reg = reg_from_hex(&peer.expect("REG"));
    let mut pool = PoolMem::new(LEN);
    // SAFETY: the range is `pool`, which outlives the registration.
    unsafe { backend.register_host_memory(pool.ptr(), LEN) }.unwrap();
    let region = backend.open_region(&reg, None, peer.pid()).unwrap();

    let ops = reversed_pages(31, LEN as u64, 0);
    // SAFETY: host ranges inside `pool`.
    unsafe { region.copy_to_host(&ops, pool.ptr()) }.unwrap();
    assert_copied_to_host(pool.bytes(), &ops, 1);

    fill(pool.bytes_mut(), 2);
    // SAFETY: the host range is `pool`.
    unsafe { region.copy_from_host(&[op_from_start(31, LEN as u64)], pool.ptr()) }.unwrap();
    assert_eq!(peer.verify(2), "OK");

    drop(region);
    // SAFETY: no copy in flight.
    unsafe { backend.unregister_host_memory(pool.ptr()) }.unwrap();
    peer.send("exit");
}
