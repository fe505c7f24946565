//! HIP backend (AMD GPUs), the same contract as [`crate::cuda`] over `libamdhip64.so`
//! loaded at run time with `libloading`. It builds without ROCm: the few entry points are
//! declared here by hand from the HIP headers (ROCm 6.x signatures).
//!
//! **Never run on AMD hardware.** It compiles, it shares the transfer engine
//! (`engine.rs`) that runs on NVIDIA GPUs, and without ROCm it reports the missing
//! library; its own calls have not executed against a real HIP runtime. Treat the first
//! run on an MI-series machine as its test (`gpu/tests/hip.rs` is written for it).
//!
//! Events (`hipEventRecord`/`hipStreamWaitEvent`/`hipEventQuery`) are wired as on CUDA,
//! so the load fence is signalled from the GPU and copy calls run in pipelined stages;
//! like the rest, never executed on AMD hardware.
//!
//! Differences from CUDA handled here: `hipIpcOpenMemHandle` accepts only the lazy peer
//! access flag; `hipStreamWaitValue64` takes a mask; a device is made current with
//! `hipSetDevice` (per thread) instead of a context; when `hipDeviceGetUuid` gives
//! nothing usable the device identity falls back to its PCI bus id (see
//! [`device_identity`]).

use std::ffi::{c_char, c_void, CStr};
use std::sync::Mutex;

use crate::engine::{DeviceApi, Dir, GpuBackend, Item};
use crate::error::format_uuid;
use crate::{new_registration, Backend, GpuError, MemoryKind, MemoryRegistration};

const LIBRARY: &str = "libamdhip64.so";
const CANDIDATES: &[&str] = &["libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6", "/opt/rocm/lib/libamdhip64.so"];

type HipError = i32;
const HIP_SUCCESS: HipError = 0;
/// hipErrorNoDevice
const HIP_ERROR_NO_DEVICE: HipError = 100;
/// hipErrorNotReady: what hipEventQuery says while the recorded work is still running.
const HIP_ERROR_NOT_READY: HipError = 600;
const HIP_MEMCPY_HOST_TO_DEVICE: i32 = 1;
const HIP_MEMCPY_DEVICE_TO_HOST: i32 = 2;
const HIP_HOST_REGISTER_PORTABLE: u32 = 0x1;
const HIP_HOST_REGISTER_MAPPED: u32 = 0x2;
const HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: u32 = 0x1;
const HIP_STREAM_NON_BLOCKING: u32 = 0x1;
const HIP_STREAM_WAIT_VALUE_GTE: u32 = 0x0;
const HIP_POINTER_ATTRIBUTE_DEVICE_ORDINAL: i32 = 9;
/// hipEventDisableTiming: events are only used for ordering, timing would cost.
const HIP_EVENT_DISABLE_TIMING: u32 = 0x2;

/// A HIP stream handle (`hipStream_t`).
pub type HipStream = *mut c_void;

/// `hipEvent_t`.
type HipEvent = *mut c_void;

/// `hipIpcMemHandle_t`, passed by value to hipIpcOpenMemHandle.
#[repr(C)]
#[derive(Clone, Copy)]
struct HipIpcMemHandle {
    reserved: [u8; 64],
}

/// `hipUUID`.
#[repr(C)]
struct HipUuid {
    bytes: [u8; 16],
}

/// The entry points used, resolved once.
struct Hip {
    _lib: libloading::Library,
    init: unsafe extern "C" fn(u32) -> HipError,
    get_device_count: unsafe extern "C" fn(*mut i32) -> HipError,
    device_get: unsafe extern "C" fn(*mut i32, i32) -> HipError,
    set_device: unsafe extern "C" fn(i32) -> HipError,
    get_device: unsafe extern "C" fn(*mut i32) -> HipError,
    device_get_uuid: unsafe extern "C" fn(*mut HipUuid, i32) -> HipError,
    device_get_pci_bus_id: unsafe extern "C" fn(*mut c_char, i32, i32) -> HipError,
    get_error_name: unsafe extern "C" fn(HipError) -> *const c_char,
    ipc_get_mem_handle: unsafe extern "C" fn(*mut HipIpcMemHandle, *mut c_void) -> HipError,
    ipc_open_mem_handle: unsafe extern "C" fn(*mut *mut c_void, HipIpcMemHandle, u32) -> HipError,
    ipc_close_mem_handle: unsafe extern "C" fn(*mut c_void) -> HipError,
    mem_get_address_range: unsafe extern "C" fn(*mut *mut c_void, *mut usize, *mut c_void) -> HipError,
    pointer_get_attribute: unsafe extern "C" fn(*mut c_void, i32, *mut c_void) -> HipError,
    host_register: unsafe extern "C" fn(*mut c_void, usize, u32) -> HipError,
    host_unregister: unsafe extern "C" fn(*mut c_void) -> HipError,
    host_get_device_pointer: unsafe extern "C" fn(*mut *mut c_void, *mut c_void, u32) -> HipError,
    memcpy_async: unsafe extern "C" fn(*mut c_void, *const c_void, usize, i32, HipStream) -> HipError,
    stream_create_with_flags: unsafe extern "C" fn(*mut HipStream, u32) -> HipError,
    stream_destroy: unsafe extern "C" fn(HipStream) -> HipError,
    stream_synchronize: unsafe extern "C" fn(HipStream) -> HipError,
    stream_write_value64: unsafe extern "C" fn(HipStream, *mut c_void, u64, u32) -> HipError,
    stream_wait_value64: unsafe extern "C" fn(HipStream, *mut c_void, u64, u32, u64) -> HipError,
    event_create_with_flags: unsafe extern "C" fn(*mut HipEvent, u32) -> HipError,
    event_destroy: unsafe extern "C" fn(HipEvent) -> HipError,
    event_record: unsafe extern "C" fn(HipEvent, HipStream) -> HipError,
    event_query: unsafe extern "C" fn(HipEvent) -> HipError,
    event_synchronize: unsafe extern "C" fn(HipEvent) -> HipError,
    stream_wait_event: unsafe extern "C" fn(HipStream, HipEvent, u32) -> HipError,
}

impl Hip {
    fn load() -> Result<Self, GpuError> {
        let mut last_err = String::new();
        let mut lib = None;
        for name in CANDIDATES {
            // SAFETY: loading runs the library's initializers; libamdhip64 is designed to be
            // dlopened (PyTorch and others do).
            match unsafe { libloading::Library::new(*name) } {
                Ok(l) => {
                    lib = Some(l);
                    break;
                }
                Err(e) => {
                    // libloading keeps dlerror()'s text in the source, not in Display.
                    last_err = match std::error::Error::source(&e) {
                        Some(cause) => format!("{e}: {cause}"),
                        None => e.to_string(),
                    }
                }
            }
        }
        let lib = lib.ok_or(GpuError::LibraryMissing { library: LIBRARY, what: "AMD ROCm (HIP)", detail: last_err })?;
        macro_rules! sym {
            ($name:literal) => {{
                // SAFETY: the declared type matches the HIP header's prototype; the library
                // is kept alive in `_lib` as long as the pointer is used.
                let s = unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|_| GpuError::MissingSymbol { library: LIBRARY, symbol: $name })?;
                *s
            }};
        }
        Ok(Self {
            init: sym!("hipInit"),
            get_device_count: sym!("hipGetDeviceCount"),
            device_get: sym!("hipDeviceGet"),
            set_device: sym!("hipSetDevice"),
            get_device: sym!("hipGetDevice"),
            device_get_uuid: sym!("hipDeviceGetUuid"),
            device_get_pci_bus_id: sym!("hipDeviceGetPCIBusId"),
            get_error_name: sym!("hipGetErrorName"),
            ipc_get_mem_handle: sym!("hipIpcGetMemHandle"),
            ipc_open_mem_handle: sym!("hipIpcOpenMemHandle"),
            ipc_close_mem_handle: sym!("hipIpcCloseMemHandle"),
            mem_get_address_range: sym!("hipMemGetAddressRange"),
            pointer_get_attribute: sym!("hipPointerGetAttribute"),
            host_register: sym!("hipHostRegister"),
            host_unregister: sym!("hipHostUnregister"),
            host_get_device_pointer: sym!("hipHostGetDevicePointer"),
            memcpy_async: sym!("hipMemcpyAsync"),
            stream_create_with_flags: sym!("hipStreamCreateWithFlags"),
            stream_destroy: sym!("hipStreamDestroy"),
            stream_synchronize: sym!("hipStreamSynchronize"),
            stream_write_value64: sym!("hipStreamWriteValue64"),
            stream_wait_value64: sym!("hipStreamWaitValue64"),
            event_create_with_flags: sym!("hipEventCreateWithFlags"),
            event_destroy: sym!("hipEventDestroy"),
            event_record: sym!("hipEventRecord"),
            event_query: sym!("hipEventQuery"),
            event_synchronize: sym!("hipEventSynchronize"),
            stream_wait_event: sym!("hipStreamWaitEvent"),
            _lib: lib,
        })
    }

    fn check(&self, call: &'static str, r: HipError) -> Result<(), GpuError> {
        if r == HIP_SUCCESS {
            return Ok(());
        }
        // SAFETY: hipGetErrorName returns a static string (or null) for any code.
        let name = unsafe { (self.get_error_name)(r) };
        let name = if name.is_null() {
            "unknown hipError".to_string()
        } else {
            // SAFETY: non-null, NUL-terminated static string from the runtime.
            unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
        };
        Err(GpuError::Driver { call, code: r, name })
    }
}

/// Loads libamdhip64 and runs `hipInit` once; a failure is retried on the next call.
fn hip() -> Result<&'static Hip, GpuError> {
    static LOADED: Mutex<Option<&'static Hip>> = Mutex::new(None);
    let mut loaded = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(h) = *loaded {
        return Ok(h);
    }
    let h = Hip::load()?;
    // SAFETY: hipInit has no preconditions.
    h.check("hipInit", unsafe { (h.init)(0) })?;
    // Leaked on purpose: unloading a GPU runtime while streams or mappings exist is unsound,
    // and the backend is cached for the life of the process anyway.
    let h: &'static Hip = Box::leak(Box::new(h));
    *loaded = Some(h);
    Ok(h)
}

/// Loads HIP, for callers that only want to know whether it is there.
pub fn init() -> Result<(), GpuError> {
    hip().map(|_| ())
}

pub(crate) fn backend() -> Result<std::sync::Arc<dyn Backend>, GpuError> {
    Ok(std::sync::Arc::new(GpuBackend::new(HipApi(hip()?))))
}

/// Number of HIP devices visible to this process.
pub fn device_count() -> Result<i32, GpuError> {
    HipApi(hip()?).device_count()
}

/// Identity of device `ordinal` as carried in [`MemoryRegistration::device_uuid`]: the
/// `hipDeviceGetUuid` bytes, or, when those are all zero or the call fails (older ROCm,
/// some virtualized GPUs), `"PCI:"` followed by the first 12 bytes of the PCI bus id
/// (`0000:c1:00.0`). Workers and the pool use this same rule, so both agree.
pub fn device_identity(ordinal: i32) -> Result<[u8; 16], GpuError> {
    HipApi(hip()?).device_uuid(ordinal)
}

pub(crate) struct HipApi(&'static Hip);

thread_local! {
    /// Devices that were current before each nested `bind` on this thread (HIP has no
    /// context stack of its own).
    static PREVIOUS_DEVICE: std::cell::RefCell<Vec<i32>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[derive(Clone, Copy)]
pub(crate) struct HipStreamHandle(HipStream);

// SAFETY: a hipStream_t is a runtime handle usable from any thread of the process; the
// engine hands each stream set to one copy call at a time.
unsafe impl Send for HipStreamHandle {}

#[derive(Clone, Copy)]
pub(crate) struct HipEventHandle(HipEvent);

// SAFETY: as HipStreamHandle: a runtime handle, used by one copy call at a time.
unsafe impl Send for HipEventHandle {}

impl DeviceApi for HipApi {
    const API: &'static str = "HIP";
    const KIND: MemoryKind = MemoryKind::Hip;
    /// The device ordinal; `hipSetDevice` makes it current per thread.
    type Device = i32;
    type Stream = HipStreamHandle;
    /// Used for the GPU-side load fence signal and pipelined copy stages, as on CUDA.
    type Event = HipEventHandle;

    fn device_count(&self) -> Result<i32, GpuError> {
        let mut n = 0;
        // SAFETY: out-pointer to a local.
        match unsafe { (self.0.get_device_count)(&mut n) } {
            HIP_ERROR_NO_DEVICE => Ok(0),
            r => self.0.check("hipGetDeviceCount", r).map(|()| n),
        }
    }

    fn device_uuid(&self, ordinal: i32) -> Result<[u8; 16], GpuError> {
        let h = self.0;
        let mut dev = 0;
        // SAFETY: out-pointer to a local.
        h.check("hipDeviceGet", unsafe { (h.device_get)(&mut dev, ordinal) })?;
        let mut uuid = HipUuid { bytes: [0; 16] };
        // SAFETY: out-pointer to a local 16-byte hipUUID.
        let r = unsafe { (h.device_get_uuid)(&mut uuid, dev) };
        if r == HIP_SUCCESS && uuid.bytes != [0; 16] {
            return Ok(uuid.bytes);
        }
        let mut bus = [0 as c_char; 64];
        // SAFETY: the buffer holds `len` bytes as passed.
        h.check("hipDeviceGetPCIBusId", unsafe { (h.device_get_pci_bus_id)(bus.as_mut_ptr(), bus.len() as i32, dev) })?;
        let mut id = [0u8; 16];
        id[..4].copy_from_slice(b"PCI:");
        for (dst, &src) in id[4..].iter_mut().zip(bus.iter().take_while(|&&c| c != 0)) {
            *dst = src as u8;
        }
        Ok(id)
    }

    fn open_device(&self, ordinal: i32) -> Result<i32, GpuError> {
        Ok(ordinal)
    }

    fn bind(&self, dev: &i32) -> Result<(), GpuError> {
        let mut prev = 0;
        // SAFETY: out-pointer to a local.
        let r = unsafe { (self.0.get_device)(&mut prev) };
        self.0.check("hipGetDevice", r)?;
        // SAFETY: plain call with a device ordinal validated by the runtime.
        let r = unsafe { (self.0.set_device)(*dev) };
        self.0.check("hipSetDevice", r)?;
        PREVIOUS_DEVICE.with(|p| p.borrow_mut().push(prev));
        Ok(())
    }

    fn unbind(&self) {
        if let Some(prev) = PREVIOUS_DEVICE.with(|p| p.borrow_mut().pop()) {
            // SAFETY: restores a device ordinal the runtime reported as current.
            let _ = unsafe { (self.0.set_device)(prev) };
        }
    }

    fn create_stream(&self) -> Result<HipStreamHandle, GpuError> {
        let mut s: HipStream = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the device is bound by the engine.
        self.0.check("hipStreamCreateWithFlags", unsafe { (self.0.stream_create_with_flags)(&mut s, HIP_STREAM_NON_BLOCKING) })?;
        Ok(HipStreamHandle(s))
    }

    fn destroy_stream(&self, stream: HipStreamHandle) {
        // SAFETY: created by create_stream, no pending work (synchronized by the engine).
        let _ = unsafe { (self.0.stream_destroy)(stream.0) };
    }

    unsafe fn copy_async(&self, dir: Dir, Item { host, device, len }: Item, stream: HipStreamHandle) -> Result<(), GpuError> {
        let dev = device as *mut c_void;
        let (dst, src, kind) = match dir {
            Dir::DeviceToHost => (host.cast(), dev.cast_const(), HIP_MEMCPY_DEVICE_TO_HOST),
            Dir::HostToDevice => (dev, host.cast_const().cast(), HIP_MEMCPY_HOST_TO_DEVICE),
        };
        // SAFETY: forwarded contract of DeviceApi::copy_async.
        let r = unsafe { (self.0.memcpy_async)(dst, src, len, kind, stream.0) };
        self.0.check("hipMemcpyAsync", r)
    }

    fn create_event(&self) -> Result<HipEventHandle, GpuError> {
        let mut ev: HipEvent = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the device is bound by the engine.
        self.0.check("hipEventCreateWithFlags", unsafe { (self.0.event_create_with_flags)(&mut ev, HIP_EVENT_DISABLE_TIMING) })?;
        Ok(HipEventHandle(ev))
    }

    fn destroy_event(&self, event: HipEventHandle) {
        // SAFETY: created by create_event; nothing waits on it any more.
        let _ = unsafe { (self.0.event_destroy)(event.0) };
    }

    fn wait_event(&self, waiter: HipStreamHandle, event: HipEventHandle) -> Result<(), GpuError> {
        // SAFETY: live event and stream of the bound device; flags must be 0.
        self.0.check("hipStreamWaitEvent", unsafe { (self.0.stream_wait_event)(waiter.0, event.0, 0) })
    }

    fn join(&self, waiter: HipStreamHandle, event: HipEventHandle, other: HipStreamHandle) -> Result<(), GpuError> {
        // SAFETY: live event and streams of the bound device.
        self.0.check("hipEventRecord", unsafe { (self.0.event_record)(event.0, other.0) })?;
        // SAFETY: as above; flags must be 0.
        self.0.check("hipStreamWaitEvent", unsafe { (self.0.stream_wait_event)(waiter.0, event.0, 0) })
    }

    fn record(&self, event: HipEventHandle, stream: HipStreamHandle) -> Result<(), GpuError> {
        // SAFETY: live event and stream of the bound device.
        self.0.check("hipEventRecord", unsafe { (self.0.event_record)(event.0, stream.0) })
    }

    fn event_done(&self, event: HipEventHandle) -> Result<bool, GpuError> {
        // SAFETY: live event.
        match unsafe { (self.0.event_query)(event.0) } {
            HIP_ERROR_NOT_READY => Ok(false),
            r => self.0.check("hipEventQuery", r).map(|()| true),
        }
    }

    fn event_wait(&self, event: HipEventHandle) -> Result<(), GpuError> {
        // SAFETY: live event.
        self.0.check("hipEventSynchronize", unsafe { (self.0.event_synchronize)(event.0) })
    }

    unsafe fn wait_value64(&self, stream: HipStreamHandle, addr: u64, value: u64) -> Result<(), GpuError> {
        // SAFETY: forwarded contract. Note HIP's GTE is a plain (not cyclic) comparison;
        // fence values are far from wrapping.
        unsafe { stream_wait_value64(stream.0, addr as *mut c_void, value) }
    }

    unsafe fn write_value64(&self, stream: HipStreamHandle, addr: u64, value: u64) -> Result<(), GpuError> {
        // SAFETY: forwarded contract.
        unsafe { stream_write_value64(stream.0, addr as *mut c_void, value) }
    }

    fn synchronize(&self, stream: HipStreamHandle) -> Result<(), GpuError> {
        // SAFETY: a live stream.
        self.0.check("hipStreamSynchronize", unsafe { (self.0.stream_synchronize)(stream.0) })
    }

    unsafe fn ipc_open(&self, handle: &[u8; 64]) -> Result<u64, GpuError> {
        let mut ptr: *mut c_void = std::ptr::null_mut();
        let h = HipIpcMemHandle { reserved: *handle };
        // SAFETY: out-pointer to a local; the runtime validates the handle. HIP accepts
        // only the lazy-peer-access flag here.
        self.0.check("hipIpcOpenMemHandle", unsafe { (self.0.ipc_open_mem_handle)(&mut ptr, h, HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) })?;
        Ok(ptr as u64)
    }

    unsafe fn ipc_close(&self, ptr: u64) -> Result<(), GpuError> {
        // SAFETY: forwarded contract: ptr came from ipc_open.
        self.0.check("hipIpcCloseMemHandle", unsafe { (self.0.ipc_close_mem_handle)(ptr as *mut c_void) })
    }

    fn address_range(&self, ptr: u64) -> Result<(u64, u64), GpuError> {
        let mut base: *mut c_void = std::ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: out-pointers to locals; the runtime validates ptr.
        self.0.check("hipMemGetAddressRange", unsafe { (self.0.mem_get_address_range)(&mut base, &mut size, ptr as *mut c_void) })?;
        Ok((base as u64, size as u64))
    }

    unsafe fn host_register(&self, base: *mut u8, len: usize) -> Result<(), GpuError> {
        let flags = HIP_HOST_REGISTER_PORTABLE | HIP_HOST_REGISTER_MAPPED;
        // SAFETY: forwarded contract: mapped memory of this process.
        self.0.check("hipHostRegister", unsafe { (self.0.host_register)(base.cast(), len, flags) })
    }

    unsafe fn host_unregister(&self, base: *mut u8) -> Result<(), GpuError> {
        // SAFETY: forwarded contract: base was registered.
        self.0.check("hipHostUnregister", unsafe { (self.0.host_unregister)(base.cast()) })
    }
}

/// Worker side: registration of `len` bytes at device pointer `ptr` for the pool; the
/// HIP twin of [`crate::cuda::export_cuda_memory`] (exports the allocation's base,
/// `offset = ptr - base`, device identity per [`device_identity`]). Never run on AMD
/// hardware (see the module docs).
pub fn export_hip_memory(ptr: u64, len: u64, alloc_id: u32) -> Result<MemoryRegistration, GpuError> {
    let kind = MemoryKind::Hip;
    let h = hip()?;
    let api = HipApi(h);
    if ptr == 0 || len == 0 {
        return Err(GpuError::invalid(kind, "null pointer or zero length"));
    }
    let mut ordinal: i32 = -1;
    // SAFETY: the attribute is an int, written to a local.
    h.check("hipPointerGetAttribute(DEVICE_ORDINAL)", unsafe {
        (h.pointer_get_attribute)((&mut ordinal as *mut i32).cast(), HIP_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr as *mut c_void)
    })?;
    let (base, size) = api.address_range(ptr)?;
    let offset = ptr - base;
    if offset.checked_add(len).is_none_or(|end| end > size) {
        return Err(GpuError::invalid(kind, format!("{ptr:#x}+{len} passes the end of its allocation {base:#x}+{size}")));
    }
    let mut handle = HipIpcMemHandle { reserved: [0; 64] };
    // SAFETY: out-pointer to a local; base is the start of a live allocation (exporting the
    // base, not `ptr`, keeps HIP's own interior offset at zero so ours is the only one).
    h.check("hipIpcGetMemHandle", unsafe { (h.ipc_get_mem_handle)(&mut handle, base as *mut c_void) })?;
    let uuid = api.device_uuid(ordinal)?;
    tracing::debug!(alloc_id, uuid = %format_uuid(&uuid), offset, len, "exported HIP memory");
    let mut reg = new_registration(kind, alloc_id, ptr, offset, len);
    reg.device_uuid = uuid;
    reg.ipc_handle = handle.reserved;
    Ok(reg)
}

/// Device address under which streams see registered host memory `host`.
///
/// # Safety
/// `host` lies in a range registered with [`Backend::register_host_memory`].
pub unsafe fn host_device_pointer(host: *mut u8) -> Result<*mut c_void, GpuError> {
    let h = hip()?;
    let mut d: *mut c_void = std::ptr::null_mut();
    // SAFETY: out-pointer to a local; the runtime validates `host`.
    h.check("hipHostGetDevicePointer", unsafe { (h.host_get_device_pointer)(&mut d, host.cast(), 0) })?;
    Ok(d)
}

/// Fence ([`crate::fence`]; `hipStreamWriteValue64`): enqueue a write of `value` to `ptr`.
///
/// # Safety
/// `stream` is live; `ptr` is an 8-byte aligned device-accessible word that stays mapped
/// until the stream ran the write.
pub unsafe fn stream_write_value64(stream: HipStream, ptr: *mut c_void, value: u64) -> Result<(), GpuError> {
    let h = hip()?;
    // SAFETY: forwarded contract.
    h.check("hipStreamWriteValue64", unsafe { (h.stream_write_value64)(stream, ptr, value, 0) })
}

/// Fence ([`crate::fence`]; `hipStreamWaitValue64`, full mask): `stream` waits until the word
/// at `ptr` is >= `value`.
///
/// # Safety
/// As [`stream_write_value64`].
pub unsafe fn stream_wait_value64(stream: HipStream, ptr: *mut c_void, value: u64) -> Result<(), GpuError> {
    let h = hip()?;
    // SAFETY: forwarded contract.
    h.check("hipStreamWaitValue64", unsafe { (h.stream_wait_value64)(stream, ptr, value, HIP_STREAM_WAIT_VALUE_GTE, u64::MAX) })
}
