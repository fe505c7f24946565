//! CUDA backend over the driver API, loaded at run time through `cudarc`'s `sys` bindings
//! (`dynamic-loading`): nothing links against libcuda, so this builds and the crate runs on
//! machines without NVIDIA software, where [`crate::backend_for`] reports the missing
//! library instead of panicking.
//!
//! Symbols are the CUDA 12.8 ABI names (`cuMemcpyDtoHAsync_v2`, `cuIpcOpenMemHandle_v2`,
//! `cuDeviceGetUuid_v2`, ...). Every 12.x and 13.x driver exports them (drivers keep the
//! ABI of older toolkits), so one binary works with both. They are looked up once before
//! `cuInit`, because `cudarc` panics on a missing symbol at its first call.
//!
//! Pool side: one transfer engine per GPU found by UUID, holding the device's primary
//! context (shared with anything else in the process that uses the runtime API), IPC
//! handles opened with lazy peer access, pool DRAM registered portable and device-mapped,
//! copies as async memcpys over a few non-blocking streams, then synchronized.
//!
//! Worker side: [`export_cuda_memory`]. Allocations made with the virtual memory API
//! (`cuMemCreate`, which PyTorch uses with `expandable_segments:True`) cannot be exported
//! with legacy IPC; the export fails with the driver's error then.

use std::ffi::c_void;
use std::sync::Mutex;

pub use cudarc::driver::sys;
use sys::{CUcontext, CUdevice, CUdeviceptr, CUresult, CUstream};

use crate::engine::{DeviceApi, Dir, GpuBackend, Item};
use crate::error::format_uuid;
use crate::{new_registration, Backend, GpuError, MemoryKind, MemoryRegistration};

const LIBRARY: &str = "libcuda.so";

/// Every driver symbol this crate calls, checked before the first call.
const SYMBOLS: &[&str] = &[
    "cuInit", "cuDeviceGetCount", "cuDeviceGet", "cuDeviceGetUuid_v2", "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent", "cuCtxSetCurrent", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2", "cuStreamCreate", "cuStreamDestroy_v2",
    "cuStreamSynchronize", "cuMemcpyDtoHAsync_v2", "cuMemcpyHtoDAsync_v2", "cuIpcGetMemHandle", "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle", "cuMemGetAddressRange_v2", "cuMemHostRegister_v2", "cuMemHostUnregister", "cuMemHostGetDevicePointer_v2",
    "cuPointerGetAttribute", "cuStreamWriteValue64_v2", "cuStreamWaitValue64_v2", "cuStreamGetCtx", "cuEventCreate", "cuEventDestroy_v2",
    "cuEventRecord", "cuEventQuery", "cuEventSynchronize", "cuStreamWaitEvent", "cuDeviceGetAttribute", "cuDeviceGetName",
    "cuModuleLoadData", "cuModuleGetFunction", "cuLaunchKernel", "cuMemHostAlloc", "cuMemFreeHost", "cuMemAlloc_v2", "cuMemFree_v2",
];

/// Batched copy entry point, if the driver has one (CUDA 12.8+): `_v2` is the 13.x ABI
/// (no `failIdx`), the plain name the 12.8 ABI.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BatchAbi {
    None,
    V1,
    V2,
}

static BATCH_ABI: std::sync::OnceLock<BatchAbi> = std::sync::OnceLock::new();

/// `cuMemcpyBatchAsync_v2` (CUDA 13 ABI). Resolved by hand: the crate's 12.8 bindings do
/// not declare it.
type BatchV2 = unsafe extern "C" fn(
    *mut CUdeviceptr,
    *mut CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    CUstream,
) -> CUresult;
static BATCH_V2: std::sync::OnceLock<BatchV2> = std::sync::OnceLock::new();
/// Set when a batch call failed once: later calls go one copy at a time.
static BATCH_BROKEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Which batched copy call this driver offers (`"cuMemcpyBatchAsync_v2"`,
/// `"cuMemcpyBatchAsync"` or `"none"`), after [`init`].
pub fn batch_copy_api() -> &'static str {
    match BATCH_ABI.get().copied().unwrap_or(BatchAbi::None) {
        BatchAbi::V2 => "cuMemcpyBatchAsync_v2",
        BatchAbi::V1 => "cuMemcpyBatchAsync",
        BatchAbi::None => "none",
    }
}

/// Maps a driver status to a result naming the call and the error
/// (`cuIpcOpenMemHandle failed: CUDA_ERROR_INVALID_VALUE (1)`).
fn check(call: &'static str, r: CUresult) -> Result<(), GpuError> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Driver { call, code: r as i32, name: format!("{r:?}") })
    }
}

/// Loads libcuda, checks the symbols and runs `cuInit` once. A failure is not remembered:
/// the next call tries again (and fails again, cheaply, on a machine without CUDA).
pub fn init() -> Result<(), GpuError> {
    static DONE: Mutex<bool> = Mutex::new(false);
    let mut done = DONE.lock().unwrap_or_else(|e| e.into_inner());
    if *done {
        return Ok(());
    }
    // SAFETY: only tries to dlopen the candidate names; it must run before any other sys
    // call because those panic when the library is absent.
    if !unsafe { sys::is_culib_present() } {
        return Err(GpuError::LibraryMissing {
            library: LIBRARY,
            what: "NVIDIA",
            detail: "no libcuda.so or libcuda.so.1 on the dynamic loader's path".into(),
        });
    }
    // SAFETY: the library is present (checked above), so culib() returns it.
    let lib = unsafe { sys::culib() };
    for &symbol in SYMBOLS {
        // SAFETY: only the symbol's address is looked up; it is never called through this
        // untyped handle.
        if unsafe { lib.get::<*const c_void>(symbol.as_bytes()) }.is_err() {
            return Err(GpuError::MissingSymbol { library: LIBRARY, symbol });
        }
    }
    let has = |name: &[u8]| {
        // SAFETY: only the symbol's address is looked up.
        unsafe { lib.get::<*const c_void>(name) }.is_ok()
    };
    // SAFETY: the declared type is the CUDA 13 prototype of this symbol; the library stays
    // loaded for the life of the process (cudarc keeps it in a static).
    let v2 = unsafe { lib.get::<BatchV2>(b"cuMemcpyBatchAsync_v2") }.ok().map(|f| *f);
    let abi = if let Some(f) = v2 {
        let _ = BATCH_V2.set(f);
        BatchAbi::V2
    } else if has(b"cuMemcpyBatchAsync") {
        BatchAbi::V1
    } else {
        BatchAbi::None
    };
    let _ = BATCH_ABI.set(abi);
    // SAFETY: cuInit has no preconditions; repeated calls are harmless.
    check("cuInit", unsafe { sys::cuInit(0) })?;
    *done = true;
    Ok(())
}

pub(crate) fn backend() -> Result<std::sync::Arc<dyn Backend>, GpuError> {
    init()?;
    Ok(std::sync::Arc::new(GpuBackend::new(Cuda)))
}

/// Number of CUDA devices visible to this process (0 when none), after [`init`].
pub fn device_count() -> Result<i32, GpuError> {
    init()?;
    Cuda.device_count()
}

/// UUID of device `ordinal`, the identity that travels in [`MemoryRegistration::device_uuid`].
pub fn device_uuid(ordinal: i32) -> Result<[u8; 16], GpuError> {
    init()?;
    Cuda.device_uuid(ordinal)
}

pub(crate) struct Cuda;

/// A device's primary context, retained while the engine lives.
pub(crate) struct CudaDevice {
    dev: CUdevice,
    ctx: CUcontext,
}

// SAFETY: a CUcontext is a driver handle usable from any thread (it is made current per
// thread with cuCtxPushCurrent before use).
unsafe impl Send for CudaDevice {}
// SAFETY: as above; the handle is never mutated.
unsafe impl Sync for CudaDevice {}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // SAFETY: balances the retain in open_device.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) };
    }
}

#[derive(Clone, Copy)]
pub(crate) struct CudaStream(CUstream);

// SAFETY: a CUstream is a driver handle usable from any thread of the process; the engine
// hands each stream set to one copy call at a time.
unsafe impl Send for CudaStream {}

#[derive(Clone, Copy)]
pub(crate) struct CudaEvent(sys::CUevent);

// SAFETY: as CudaStream: a driver handle, used by one copy call at a time.
unsafe impl Send for CudaEvent {}

fn location(type_: sys::CUmemLocationType, id: i32) -> sys::CUmemLocation {
    sys::CUmemLocation { type_, id }
}

fn get_device(ordinal: i32) -> Result<CUdevice, GpuError> {
    let mut dev: CUdevice = 0;
    // SAFETY: out-pointer to a local.
    check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut dev, ordinal) })?;
    Ok(dev)
}

impl DeviceApi for Cuda {
    const API: &'static str = "CUDA";
    const KIND: MemoryKind = MemoryKind::Cuda;
    type Device = CudaDevice;
    type Stream = CudaStream;
    type Event = CudaEvent;

    fn device_count(&self) -> Result<i32, GpuError> {
        let mut n = 0;
        // SAFETY: out-pointer to a local.
        match unsafe { sys::cuDeviceGetCount(&mut n) } {
            CUresult::CUDA_ERROR_NO_DEVICE => Ok(0),
            r => check("cuDeviceGetCount", r).map(|()| n),
        }
    }

    fn device_uuid(&self, ordinal: i32) -> Result<[u8; 16], GpuError> {
        let dev = get_device(ordinal)?;
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: out-pointer to a local.
        check("cuDeviceGetUuid_v2", unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, dev) })?;
        Ok(uuid.bytes.map(|b| b as u8))
    }

    fn open_device(&self, ordinal: i32) -> Result<CudaDevice, GpuError> {
        let dev = get_device(ordinal)?;
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; released in CudaDevice::drop.
        check("cuDevicePrimaryCtxRetain", unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) })?;
        Ok(CudaDevice { dev, ctx })
    }

    fn bind(&self, dev: &CudaDevice) -> Result<(), GpuError> {
        // Push/pop rather than set: the thread's own current context comes back on unbind.
        // SAFETY: the context is retained for as long as `dev` lives.
        check("cuCtxPushCurrent", unsafe { sys::cuCtxPushCurrent_v2(dev.ctx) })
    }

    fn unbind(&self) {
        let mut popped: CUcontext = std::ptr::null_mut();
        // SAFETY: pops the context pushed by the matching bind.
        let _ = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
    }

    fn create_stream(&self) -> Result<CudaStream, GpuError> {
        let mut s: CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: out-pointer to a local; a context is bound by the engine.
        check("cuStreamCreate", unsafe { sys::cuStreamCreate(&mut s, flags) })?;
        Ok(CudaStream(s))
    }

    fn destroy_stream(&self, stream: CudaStream) {
        // SAFETY: the stream was created by create_stream and has no pending work (the
        // engine synchronizes before returning a set).
        let _ = unsafe { sys::cuStreamDestroy_v2(stream.0) };
    }

    unsafe fn copy_async(&self, dir: Dir, Item { host, device, len }: Item, stream: CudaStream) -> Result<(), GpuError> {
        // SAFETY: forwarded contract of DeviceApi::copy_async.
        unsafe {
            match dir {
                Dir::DeviceToHost => check("cuMemcpyDtoHAsync", sys::cuMemcpyDtoHAsync_v2(host.cast(), device, len, stream.0)),
                Dir::HostToDevice => check("cuMemcpyHtoDAsync", sys::cuMemcpyHtoDAsync_v2(device, host.cast_const().cast(), len, stream.0)),
            }
        }
    }

    unsafe fn copy_batch_async(&self, dev: &CudaDevice, dir: Dir, items: &[Item], stream: CudaStream, batch: bool) -> Result<(), GpuError> {
        use std::sync::atomic::Ordering;
        let abi = BATCH_ABI.get().copied().unwrap_or(BatchAbi::None);
        if !batch || abi == BatchAbi::None || items.len() < 2 || BATCH_BROKEN.load(Ordering::Relaxed) {
            for it in items {
                // SAFETY: forwarded contract.
                unsafe { self.copy_async(dir, *it, stream) }?;
            }
            return Ok(());
        }
        let host = |it: &Item| it.host as CUdeviceptr;
        let (mut dsts, mut srcs): (Vec<CUdeviceptr>, Vec<CUdeviceptr>) = match dir {
            Dir::DeviceToHost => (items.iter().map(host).collect(), items.iter().map(|i| i.device).collect()),
            Dir::HostToDevice => (items.iter().map(|i| i.device).collect(), items.iter().map(host).collect()),
        };
        let mut sizes: Vec<usize> = items.iter().map(|i| i.len).collect();
        let device = location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, dev.dev);
        let host_loc = location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST, 0);
        let (src, dst) = match dir {
            Dir::DeviceToHost => (device, host_loc),
            Dir::HostToDevice => (host_loc, device),
        };
        let mut attrs = sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: src,
            dstLocHint: dst,
            // Copy engines, not SMs: the engine's kernels keep the whole GPU.
            flags: sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32,
        };
        let mut attr_idx: usize = 0;
        let mut fail_idx: usize = usize::MAX;
        let (d, s, n, len) = (dsts.as_mut_ptr(), srcs.as_mut_ptr(), sizes.as_mut_ptr(), items.len());
        // SAFETY: the arrays hold `items.len()` entries each and outlive the call (the
        // driver copies the descriptors before returning); one attribute applies from
        // index 0 on; forwarded contract for the memory itself.
        let r = unsafe {
            match abi {
                BatchAbi::V2 => BATCH_V2.get().expect("resolved with BatchAbi::V2")(d, s, n, len, &mut attrs, &mut attr_idx, 1, stream.0),
                _ => sys::cuMemcpyBatchAsync(d, s, n, len, &mut attrs, &mut attr_idx, 1, &mut fail_idx, stream.0),
            }
        };
        if r == CUresult::CUDA_SUCCESS {
            return Ok(());
        }
        if fail_idx != usize::MAX && fail_idx != 0 {
            // Some copies were enqueued; redoing them would be harmless but the error is
            // real (a bad address): report it.
            return check("cuMemcpyBatchAsync", r);
        }
        // Refused as a whole (old driver quirk, unsupported attribute): go one by one from
        // now on, and say so once.
        if !BATCH_BROKEN.swap(true, Ordering::Relaxed) {
            tracing::warn!("cuMemcpyBatchAsync failed ({r:?}); copying one op per call from now on");
        }
        for it in items {
            // SAFETY: forwarded contract.
            unsafe { self.copy_async(dir, *it, stream) }?;
        }
        Ok(())
    }

    fn create_event(&self) -> Result<CudaEvent, GpuError> {
        let mut ev: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: out-pointer to a local; a context is bound by the engine.
        check("cuEventCreate", unsafe { sys::cuEventCreate(&mut ev, flags) })?;
        Ok(CudaEvent(ev))
    }

    fn destroy_event(&self, event: CudaEvent) {
        // SAFETY: created by create_event; nothing waits on it any more.
        let _ = unsafe { sys::cuEventDestroy_v2(event.0) };
    }

    fn join(&self, waiter: CudaStream, event: CudaEvent, other: CudaStream) -> Result<(), GpuError> {
        // SAFETY: live event and streams of the bound context.
        check("cuEventRecord", unsafe { sys::cuEventRecord(event.0, other.0) })?;
        // SAFETY: as above.
        check("cuStreamWaitEvent", unsafe { sys::cuStreamWaitEvent(waiter.0, event.0, 0) })
    }

    fn wait_event(&self, waiter: CudaStream, event: CudaEvent) -> Result<(), GpuError> {
        // SAFETY: live event and stream of the bound context.
        check("cuStreamWaitEvent", unsafe { sys::cuStreamWaitEvent(waiter.0, event.0, 0) })
    }

    fn record(&self, event: CudaEvent, stream: CudaStream) -> Result<(), GpuError> {
        // SAFETY: live event and stream of the bound context.
        check("cuEventRecord", unsafe { sys::cuEventRecord(event.0, stream.0) })
    }

    fn event_done(&self, event: CudaEvent) -> Result<bool, GpuError> {
        // SAFETY: live event.
        match unsafe { sys::cuEventQuery(event.0) } {
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check("cuEventQuery", r).map(|()| true),
        }
    }

    fn event_wait(&self, event: CudaEvent) -> Result<(), GpuError> {
        // SAFETY: live event.
        check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(event.0) })
    }

    unsafe fn wait_value64(&self, stream: CudaStream, addr: u64, value: u64) -> Result<(), GpuError> {
        // SAFETY: forwarded contract.
        unsafe { stream_wait_value64(stream.0, addr, value) }
    }

    unsafe fn write_value64(&self, stream: CudaStream, addr: u64, value: u64) -> Result<(), GpuError> {
        // SAFETY: forwarded contract.
        unsafe { stream_write_value64(stream.0, addr, value) }
    }

    fn synchronize(&self, stream: CudaStream) -> Result<(), GpuError> {
        // SAFETY: a live stream of the bound context.
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(stream.0) })
    }

    unsafe fn ipc_open(&self, handle: &[u8; 64]) -> Result<u64, GpuError> {
        let h = sys::CUipcMemHandle { reserved: handle.map(|b| b as std::ffi::c_char) };
        let mut ptr: CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: out-pointer to a local; the handle bytes are validated by the driver.
        check("cuIpcOpenMemHandle", unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, h, flags) })?;
        Ok(ptr)
    }

    unsafe fn ipc_close(&self, ptr: u64) -> Result<(), GpuError> {
        // SAFETY: forwarded contract: ptr came from ipc_open.
        check("cuIpcCloseMemHandle", unsafe { sys::cuIpcCloseMemHandle(ptr) })
    }

    fn address_range(&self, ptr: u64) -> Result<(u64, u64), GpuError> {
        let (mut base, mut size): (CUdeviceptr, usize) = (0, 0);
        // SAFETY: out-pointers to locals; the driver validates ptr.
        check("cuMemGetAddressRange", unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) })?;
        Ok((base, size as u64))
    }

    unsafe fn host_register(&self, base: *mut u8, len: usize) -> Result<(), GpuError> {
        // DEVICEMAP makes pool memory addressable by streams, which the fence words
        // ([`crate::fence`]) need; on 64-bit systems with unified addressing it costs nothing more.
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: forwarded contract: the range is mapped memory of this process.
        check("cuMemHostRegister", unsafe { sys::cuMemHostRegister_v2(base.cast(), len, flags) })
    }

    unsafe fn host_unregister(&self, base: *mut u8) -> Result<(), GpuError> {
        // SAFETY: forwarded contract: base was registered.
        check("cuMemHostUnregister", unsafe { sys::cuMemHostUnregister(base.cast()) })
    }

    fn copy_kernel(&self, _dev: &CudaDevice) -> Result<u64, GpuError> {
        let src = std::ffi::CString::new(crate::gather::PTX).expect("no NUL in PTX");
        let mut module: sys::CUmodule = std::ptr::null_mut();
        let mut f: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: a NUL-terminated PTX image and out-pointers to locals; the device's
        // context is bound by the caller. The module is never unloaded: the function
        // stays valid as long as the primary context, which the engine retains.
        unsafe {
            check("cuModuleLoadData(umbp_copy_pages)", sys::cuModuleLoadData(&mut module, src.as_ptr().cast()))?;
            check("cuModuleGetFunction(umbp_copy_pages)", sys::cuModuleGetFunction(&mut f, module, crate::gather::KERNEL_NAME.as_ptr()))?;
        }
        Ok(f as u64)
    }

    fn host_pointers_are_device_pointers(&self, dev: &CudaDevice) -> Result<bool, GpuError> {
        let attr = |a: sys::CUdevice_attribute| -> Result<i32, GpuError> {
            let mut v = 0;
            // SAFETY: out-pointer to a local.
            check("cuDeviceGetAttribute", unsafe { sys::cuDeviceGetAttribute(&mut v, a, dev.dev) })?;
            Ok(v)
        };
        use sys::CUdevice_attribute::*;
        Ok(attr(CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)? == 1 && attr(CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM)? == 1)
    }

    unsafe fn launch_copy_kernel(
        &self,
        kernel: u64,
        descs: u64,
        n: u64,
        blocks: u32,
        threads: u32,
        stream: CudaStream,
    ) -> Result<(), GpuError> {
        let mut args = [descs, n];
        let mut params: [*mut c_void; 2] = [(&mut args[0] as *mut u64).cast(), (&mut args[1] as *mut u64).cast()];
        // SAFETY: the kernel takes two 8-byte parameters, pointed to by `params`, which
        // the driver copies at launch; forwarded contract for what they point to.
        check("cuLaunchKernel(umbp_copy_pages)", unsafe {
            sys::cuLaunchKernel(
                kernel as sys::CUfunction,
                blocks,
                1,
                1,
                threads,
                1,
                1,
                0,
                stream.0,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }

    fn alloc_mapped(&self, bytes: usize) -> Result<*mut u8, GpuError> {
        let mut p: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: out-pointer to a local; a context is bound by the caller.
        check("cuMemHostAlloc", unsafe { sys::cuMemHostAlloc(&mut p, bytes, flags) })?;
        Ok(p.cast())
    }

    unsafe fn free_mapped(&self, ptr: *mut u8) {
        // SAFETY: forwarded contract.
        let _ = unsafe { sys::cuMemFreeHost(ptr.cast()) };
    }

    fn alloc_device(&self, bytes: usize) -> Result<u64, GpuError> {
        let mut p: CUdeviceptr = 0;
        // SAFETY: out-pointer to a local; a context is bound by the caller.
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut p, bytes) })?;
        Ok(p)
    }

    unsafe fn free_device(&self, ptr: u64) {
        // SAFETY: forwarded contract.
        let _ = unsafe { sys::cuMemFree_v2(ptr) };
    }
}

/// Makes sure a context is current on this thread, using the primary context of the
/// device that owns `ptr` when none is (a worker thread that never touched the runtime).
fn ensure_context_for(ptr: CUdeviceptr) -> Result<(), GpuError> {
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: out-pointer to a local.
    check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut ctx) })?;
    if !ctx.is_null() {
        return Ok(());
    }
    let ordinal = pointer_ordinal(ptr)?;
    let dev = get_device(ordinal)?;
    // SAFETY: out-pointer to a local. The retain is never released: the primary context is
    // the one the worker's runtime uses and lives as long as the process anyway.
    check("cuDevicePrimaryCtxRetain", unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) })?;
    // SAFETY: ctx was just retained.
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) })
}

fn pointer_ordinal(ptr: CUdeviceptr) -> Result<i32, GpuError> {
    let mut ordinal: i32 = -1;
    let attr = sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL;
    // SAFETY: the attribute is an int, written to a local.
    check("cuPointerGetAttribute(DEVICE_ORDINAL)", unsafe { sys::cuPointerGetAttribute((&mut ordinal as *mut i32).cast(), attr, ptr) })?;
    Ok(ordinal)
}

/// Worker side: registration of `len` bytes at device pointer `ptr` for the pool.
/// Exports the containing allocation with `cuIpcGetMemHandle` (of its base, found with
/// `cuMemGetAddressRange`), records `offset = ptr - base` and the device UUID (ordinals
/// differ between processes with different `CUDA_VISIBLE_DEVICES`). Call it from a thread
/// where the allocating context is current (any thread of a PyTorch process after
/// `torch.cuda.set_device`); with no current context the device's primary context is used.
pub fn export_cuda_memory(ptr: u64, len: u64, alloc_id: u32) -> Result<MemoryRegistration, GpuError> {
    let kind = MemoryKind::Cuda;
    init()?;
    if ptr == 0 || len == 0 {
        return Err(GpuError::invalid(kind, "null pointer or zero length"));
    }
    ensure_context_for(ptr)?;
    let (base, size) = Cuda.address_range(ptr)?;
    let offset = ptr - base;
    if offset.checked_add(len).is_none_or(|end| end > size) {
        return Err(GpuError::invalid(kind, format!("{ptr:#x}+{len} passes the end of its allocation {base:#x}+{size}")));
    }
    let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: out-pointer to a local; base is the start of a live allocation.
    check("cuIpcGetMemHandle", unsafe { sys::cuIpcGetMemHandle(&mut handle, base) })?;
    let uuid = Cuda.device_uuid(pointer_ordinal(ptr)?)?;
    tracing::debug!(alloc_id, uuid = %format_uuid(&uuid), offset, len, "exported CUDA memory");
    let mut reg = new_registration(kind, alloc_id, ptr, offset, len);
    reg.device_uuid = uuid;
    reg.ipc_handle = handle.reserved.map(|b| b as u8);
    Ok(reg)
}

/// Device address under which the stream engine sees `host`, memory registered with
/// [`Backend::register_host_memory`] (device-mapped). Equal to `host` with unified
/// addressing, but asking the driver keeps it right elsewhere.
///
/// # Safety
/// `host` lies in a registered range and a context is current on this thread.
pub unsafe fn host_device_pointer(host: *mut u8) -> Result<CUdeviceptr, GpuError> {
    let mut d: CUdeviceptr = 0;
    // SAFETY: out-pointer to a local; the driver validates `host`.
    check("cuMemHostGetDevicePointer", unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, host.cast(), 0) })?;
    Ok(d)
}

/// Fence ([`crate::fence`]): enqueues on `stream` a write of `value` to the 8-byte word at `addr`
/// (a device-mapped pool or worker word), ordered after the stream's earlier work.
///
/// # Safety
/// `stream` is a live stream of the current context and `addr` an 8-byte aligned
/// device-accessible word that stays mapped until the stream has run the write.
pub unsafe fn stream_write_value64(stream: CUstream, addr: CUdeviceptr, value: u64) -> Result<(), GpuError> {
    let flags = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
    // SAFETY: forwarded contract.
    check("cuStreamWriteValue64", unsafe { sys::cuStreamWriteValue64_v2(stream, addr, value, flags) })
}

/// Fence ([`crate::fence`]): makes `stream` wait until the word at `addr` is >= `value`
/// (sequence numbers only grow). The wait is on the GPU; no CPU thread blocks.
///
/// # Safety
/// As [`stream_write_value64`].
pub unsafe fn stream_wait_value64(stream: CUstream, addr: CUdeviceptr, value: u64) -> Result<(), GpuError> {
    let flags = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
    // SAFETY: forwarded contract.
    check("cuStreamWaitValue64", unsafe { sys::cuStreamWaitValue64_v2(stream, addr, value, flags) })
}

/// Name of device `ordinal` (`NVIDIA H200`), for reports.
pub fn device_name(ordinal: i32) -> Result<String, GpuError> {
    init()?;
    let dev = get_device(ordinal)?;
    let mut buf = [0 as std::ffi::c_char; 128];
    // SAFETY: the buffer holds the length passed.
    check("cuDeviceGetName", unsafe { sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, dev) })?;
    // SAFETY: the driver NUL-terminates within the buffer.
    Ok(unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
}

/// The context to use for calls about `stream`: the stream's own, or for the legacy
/// default stream (null) the thread's current one, or else device 0's primary context.
fn context_for(stream: CUstream) -> Result<CUcontext, GpuError> {
    let mut ctx: CUcontext = std::ptr::null_mut();
    if !stream.is_null() {
        // SAFETY: out-pointer to a local; the driver validates the stream.
        check("cuStreamGetCtx", unsafe { sys::cuStreamGetCtx(stream, &mut ctx) })?;
        return Ok(ctx);
    }
    // SAFETY: out-pointer to a local.
    check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut ctx) })?;
    if !ctx.is_null() {
        return Ok(ctx);
    }
    let dev = get_device(0)?;
    // SAFETY: out-pointer to a local. Never released: registrations made in it must
    // outlive every stream that uses them, and the primary context lives with the process.
    check("cuDevicePrimaryCtxRetain", unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) })?;
    Ok(ctx)
}

/// Runs `f` with `ctx` current, restoring the thread's context afterwards.
fn with_context<T>(ctx: CUcontext, f: impl FnOnce() -> Result<T, GpuError>) -> Result<T, GpuError> {
    // SAFETY: ctx is a live context (from the driver above).
    check("cuCtxPushCurrent", unsafe { sys::cuCtxPushCurrent_v2(ctx) })?;
    let r = f();
    let mut popped: CUcontext = std::ptr::null_mut();
    // SAFETY: pops what was pushed above.
    let _ = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
    r
}

/// A small range of host memory (fence words) registered with the driver as pinned,
/// portable and device-mapped, so that streams of any context of this process can write or
/// wait on it. Unregistered on drop; the memory must stay mapped until then.
pub struct HostWords {
    ptr: *mut u8,
    ctx: CUcontext,
    device: u64,
}

// SAFETY: plain addresses and a context handle, usable from any thread.
unsafe impl Send for HostWords {}
// SAFETY: as above; nothing is mutated after creation.
unsafe impl Sync for HostWords {}

impl HostWords {
    /// Registers `[ptr, ptr+len)`, in the context of `stream` (the engine's compute stream;
    /// null: the current or device 0's primary context).
    ///
    /// # Safety
    /// The range is mapped memory of this process that stays mapped until the returned
    /// value is dropped; `stream` is null or a live stream.
    pub unsafe fn register(ptr: *mut u8, len: usize, stream: CUstream) -> Result<HostWords, GpuError> {
        init()?;
        let ctx = context_for(stream)?;
        let device = with_context(ctx, || {
            let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
            // SAFETY: forwarded contract: mapped memory of this process.
            check("cuMemHostRegister", unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, flags) })?;
            // SAFETY: the range was just registered and a context is current.
            unsafe { host_device_pointer(ptr) }.inspect_err(|_| {
                // SAFETY: undoes the registration above.
                let _ = unsafe { sys::cuMemHostUnregister(ptr.cast()) };
            })
        })?;
        Ok(HostWords { ptr, ctx, device })
    }

    /// Device address of the first byte.
    pub fn device(&self) -> u64 {
        self.device
    }
}

impl Drop for HostWords {
    fn drop(&mut self) {
        let r = with_context(self.ctx, || {
            // SAFETY: registered in `register`; callers drop this before unmapping.
            check("cuMemHostUnregister", unsafe { sys::cuMemHostUnregister(self.ptr.cast()) })
        });
        if let Err(e) = r {
            tracing::warn!("unregistering fence words: {e}");
        }
    }
}

/// Worker side of a store fence: enqueues on `stream` (the engine's compute stream, as a
/// raw `CUstream`; 0 = legacy default stream) a write of `value` to the device-mapped word
/// `addr`, after everything enqueued on it so far. Runs in the stream's own context.
///
/// # Safety
/// `stream` is 0 or a live stream; `addr` is a device-mapped word ([`HostWords`]) that
/// stays registered until the stream ran the write.
pub unsafe fn fence_write(stream: u64, addr: u64, value: u64) -> Result<(), GpuError> {
    let stream = stream as CUstream;
    with_context(context_for(stream)?, || {
        // SAFETY: forwarded contract.
        unsafe { stream_write_value64(stream, addr, value) }
    })
}

/// Worker side of a load fence: `stream` waits (on the GPU) until the word at `addr`
/// reaches `value`; kernels enqueued after it see the loaded bytes.
///
/// # Safety
/// As [`fence_write`].
pub unsafe fn fence_wait(stream: u64, addr: u64, value: u64) -> Result<(), GpuError> {
    let stream = stream as CUstream;
    with_context(context_for(stream)?, || {
        // SAFETY: forwarded contract.
        unsafe { stream_wait_value64(stream, addr, value) }
    })
}
