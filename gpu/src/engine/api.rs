//! The driver calls the engine needs, one implementation per GPU API.

use super::item::Item;
use crate::Dir;
use crate::{GpuError, MemoryKind};

/// The driver calls the engine needs. Implementations map driver errors to
/// [`GpuError::Driver`] with the call's name. Optional capabilities (batching, events,
/// stream memory operations) have defaults that report them absent; the engine then
/// falls back (one call per copy, CPU-side fence waits and writes).
pub(crate) trait DeviceApi: Send + Sync + 'static {
    /// "CUDA" or "HIP", for messages.
    const API: &'static str;
    const KIND: MemoryKind;
    /// What makes a device current on a thread (CUDA: its primary context).
    type Device: Send + Sync;
    type Stream: Copy + Send;
    type Event: Copy + Send;

    fn device_count(&self) -> Result<i32, GpuError>;
    fn device_uuid(&self, ordinal: i32) -> Result<[u8; 16], GpuError>;
    fn open_device(&self, ordinal: i32) -> Result<Self::Device, GpuError>;
    /// Makes `dev` current on the calling thread, remembering what was current; called
    /// before every batch of calls because the pool calls in from threads it does not
    /// control (in embedded mode, the worker's own threads).
    fn bind(&self, dev: &Self::Device) -> Result<(), GpuError>;
    /// Restores what was current before the matching `bind`.
    fn unbind(&self);
    fn create_stream(&self) -> Result<Self::Stream, GpuError>;
    fn destroy_stream(&self, stream: Self::Stream);
    /// # Safety
    /// `item.host[..len]` is valid (writable for DeviceToHost) until the stream is
    /// synchronized; `item.device..+len` lies inside an open allocation.
    unsafe fn copy_async(&self, dir: Dir, item: Item, stream: Self::Stream) -> Result<(), GpuError>;
    /// Enqueues every item on `stream`, in one driver call where the driver can. Default:
    /// one [`Self::copy_async`] per item.
    ///
    /// # Safety
    /// As [`Self::copy_async`] for every item.
    unsafe fn copy_batch_async(
        &self,
        dev: &Self::Device,
        dir: Dir,
        items: &[Item],
        stream: Self::Stream,
        batch: bool,
    ) -> Result<(), GpuError> {
        let _ = (dev, batch);
        for it in items {
            // SAFETY: forwarded contract.
            unsafe { self.copy_async(dir, *it, stream) }?;
        }
        Ok(())
    }
    fn synchronize(&self, stream: Self::Stream) -> Result<(), GpuError>;
    fn create_event(&self) -> Result<Self::Event, GpuError> {
        Err(GpuError::Unsupported(format!("{}: events not wired", Self::API)))
    }
    fn destroy_event(&self, _event: Self::Event) {}
    /// `waiter` waits (on the GPU) for the work enqueued on `other` so far.
    fn join(&self, waiter: Self::Stream, event: Self::Event, other: Self::Stream) -> Result<(), GpuError> {
        let _ = (waiter, event, other);
        Err(GpuError::Unsupported(format!("{}: events not wired", Self::API)))
    }
    /// `waiter` waits (on the GPU) for the work before the last [`Self::record`] of
    /// `event` (on any stream).
    fn wait_event(&self, waiter: Self::Stream, event: Self::Event) -> Result<(), GpuError> {
        let _ = (waiter, event);
        Err(GpuError::Unsupported(format!("{}: events not wired", Self::API)))
    }
    /// Records `event` on `stream`: it completes once the work enqueued so far is done.
    fn record(&self, event: Self::Event, stream: Self::Stream) -> Result<(), GpuError> {
        let _ = (event, stream);
        Err(GpuError::Unsupported(format!("{}: events not wired", Self::API)))
    }
    /// Whether the work before the last [`Self::record`] of `event` is done (no waiting).
    fn event_done(&self, event: Self::Event) -> Result<bool, GpuError> {
        let _ = event;
        Err(GpuError::Unsupported(format!("{}: events not wired", Self::API)))
    }
    /// Blocks until [`Self::event_done`] would say true; errors of that work surface here.
    fn event_wait(&self, event: Self::Event) -> Result<(), GpuError> {
        let _ = event;
        Err(GpuError::Unsupported(format!("{}: events not wired", Self::API)))
    }
    /// Enqueues a wait until the device-mapped host word at `addr` reaches `value`
    /// (cyclic `>=`).
    ///
    /// # Safety
    /// `addr` is a device-mapped 8-byte word that stays mapped until the stream passed.
    unsafe fn wait_value64(&self, stream: Self::Stream, addr: u64, value: u64) -> Result<(), GpuError>;
    /// Enqueues a write of `value` to the device-mapped word at `addr`, after the stream's
    /// earlier work, with a memory barrier before it.
    ///
    /// # Safety
    /// As [`Self::wait_value64`].
    unsafe fn write_value64(&self, stream: Self::Stream, addr: u64, value: u64) -> Result<(), GpuError>;
    /// # Safety
    /// A device is bound on this thread.
    unsafe fn ipc_open(&self, handle: &[u8; 64]) -> Result<u64, GpuError>;
    /// # Safety
    /// `ptr` came from `ipc_open` and no copy on it is in flight.
    unsafe fn ipc_close(&self, ptr: u64) -> Result<(), GpuError>;
    /// Base and size of the allocation containing `ptr`.
    fn address_range(&self, ptr: u64) -> Result<(u64, u64), GpuError>;
    /// # Safety
    /// See [`Backend::register_host_memory`](crate::Backend::register_host_memory); a device is bound on this thread.
    unsafe fn host_register(&self, base: *mut u8, len: usize) -> Result<(), GpuError>;
    /// # Safety
    /// See [`Backend::unregister_host_memory`](crate::Backend::unregister_host_memory).
    unsafe fn host_unregister(&self, base: *mut u8) -> Result<(), GpuError>;

    // Kernel path ([`crate::gather`]); defaults report it absent (copy engines only).
    /// Loads the page copy kernel for `dev` (bound); an opaque function handle.
    fn copy_kernel(&self, dev: &Self::Device) -> Result<u64, GpuError> {
        let _ = dev;
        Err(GpuError::Unsupported(format!("{}: no page copy kernel", Self::API)))
    }
    /// Whether host memory registered with [`Self::host_register`] is addressable by
    /// kernels at its host address.
    fn host_pointers_are_device_pointers(&self, dev: &Self::Device) -> Result<bool, GpuError> {
        let _ = dev;
        Ok(false)
    }
    /// Enqueues `kernel` over `n` descriptors at device address `descs` on `stream`.
    ///
    /// # Safety
    /// `descs` holds `n` [`crate::gather::Desc`] readable by the device until the stream
    /// passed the launch; each names ranges valid as in [`Self::copy_async`].
    unsafe fn launch_copy_kernel(
        &self,
        kernel: u64,
        descs: u64,
        n: u64,
        blocks: u32,
        threads: u32,
        stream: Self::Stream,
    ) -> Result<(), GpuError> {
        let _ = (kernel, descs, n, blocks, threads, stream);
        Err(GpuError::Unsupported(format!("{}: no page copy kernel", Self::API)))
    }
    /// Pinned host memory, device-mapped at its host address (a device is bound).
    fn alloc_mapped(&self, bytes: usize) -> Result<*mut u8, GpuError> {
        let _ = bytes;
        Err(GpuError::Unsupported(format!("{}: no mapped allocations", Self::API)))
    }
    /// # Safety
    /// `ptr` came from [`Self::alloc_mapped`] and nothing reads it any more.
    unsafe fn free_mapped(&self, ptr: *mut u8) {
        let _ = ptr;
    }
    /// Device memory (a device is bound).
    fn alloc_device(&self, bytes: usize) -> Result<u64, GpuError> {
        let _ = bytes;
        Err(GpuError::Unsupported(format!("{}: no device allocations", Self::API)))
    }
    /// # Safety
    /// `ptr` came from [`Self::alloc_device`] and nothing uses it any more.
    unsafe fn free_device(&self, ptr: u64) {
        let _ = ptr;
    }
}
