//! A CPU stand-in for a GPU driver, for the engine's unit tests.

use std::sync::atomic::{AtomicUsize, Ordering};

use std::sync::Mutex;

use super::{DeviceApi, Dir, Engine, Item};
use crate::{GpuError, MemoryKind};

/// A CPU stand-in for a GPU driver (no GPU on the machines that run the unit tests; the
/// real driver path runs on the device machine): "device" addresses are host
/// addresses, copies happen at once, events are done when recorded unless
/// `events_lag` makes only blocking waits see them. A copy of `fail_len` bytes fails.
pub(super) struct SimulatedDevice {
    fail_len: usize,
    events: bool,
    events_lag: bool,
    pub(super) copies: AtomicUsize,
    pub(super) ipc_opens: AtomicUsize,
    pub(super) syncs: AtomicUsize,
    /// Page copy kernel launches (the kernel runs on the CPU at once).
    pub(super) kernels: AtomicUsize,
    /// Streams created.
    pub(super) streams_made: AtomicUsize,
    /// Size of every batch handed to `copy_batch_async`, and whether batching was asked.
    pub(super) batches: Mutex<Vec<(usize, bool)>>,
    /// The stream of every batch handed to `copy_batch_async`.
    pub(super) batch_streams: Mutex<Vec<usize>>,
    /// Stream joins: device staging makes one per chunk (a GPU-side load fence one per
    /// stream after the first). Per device, unlike the process-wide `staging_stats`, so
    /// tests running in parallel do not see each other's chunks.
    pub(super) joins: AtomicUsize,
    /// Copies and kernels move no bytes (the CPU cost tests: addresses are made up).
    pub(super) dry: bool,
    /// Size `address_range` reports for every allocation.
    pub(super) alloc_len: u64,
}

impl DeviceApi for SimulatedDevice {
    const API: &'static str = "SIM";
    const KIND: MemoryKind = MemoryKind::Cuda;
    type Device = ();
    type Stream = usize;
    type Event = usize;
    fn device_count(&self) -> Result<i32, GpuError> {
        Ok(1)
    }
    fn device_uuid(&self, _: i32) -> Result<[u8; 16], GpuError> {
        Ok([7; 16])
    }
    fn open_device(&self, _: i32) -> Result<(), GpuError> {
        Ok(())
    }
    fn bind(&self, _: &()) -> Result<(), GpuError> {
        Ok(())
    }
    fn unbind(&self) {}
    fn create_stream(&self) -> Result<usize, GpuError> {
        Ok(self.streams_made.fetch_add(1, Ordering::Relaxed))
    }
    fn destroy_stream(&self, _: usize) {}
    unsafe fn copy_async(&self, dir: Dir, Item { host, device, len }: Item, _: usize) -> Result<(), GpuError> {
        if len == self.fail_len {
            return Err(GpuError::Unsupported("simulated copy failure".into()));
        }
        self.copies.fetch_add(1, Ordering::Relaxed);
        if self.dry {
            return Ok(());
        }
        let (src, dst) = match dir {
            Dir::DeviceToHost => (device as *const u8, host),
            Dir::HostToDevice => (host as *const u8, device as *mut u8),
        };
        // SAFETY: the test's items point into its own live buffers.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
        Ok(())
    }
    unsafe fn copy_batch_async(&self, _: &(), dir: Dir, items: &[Item], stream: usize, batch: bool) -> Result<(), GpuError> {
        self.batches.lock().unwrap().push((items.len(), batch));
        self.batch_streams.lock().unwrap().push(stream);
        for it in items {
            // SAFETY: forwarded contract.
            unsafe { self.copy_async(dir, *it, stream) }?;
        }
        Ok(())
    }
    fn synchronize(&self, _: usize) -> Result<(), GpuError> {
        self.syncs.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
    fn create_event(&self) -> Result<usize, GpuError> {
        if self.events {
            Ok(0)
        } else {
            Err(GpuError::Unsupported("no events".into()))
        }
    }
    fn record(&self, _: usize, _: usize) -> Result<(), GpuError> {
        Ok(())
    }
    fn event_done(&self, _: usize) -> Result<bool, GpuError> {
        Ok(!self.events_lag)
    }
    fn event_wait(&self, _: usize) -> Result<(), GpuError> {
        Ok(())
    }
    unsafe fn wait_value64(&self, _: usize, _: u64, _: u64) -> Result<(), GpuError> {
        Err(GpuError::Unsupported("no memops".into()))
    }
    unsafe fn write_value64(&self, _: usize, _: u64, _: u64) -> Result<(), GpuError> {
        Err(GpuError::Unsupported("no memops".into()))
    }
    unsafe fn ipc_open(&self, handle: &[u8; 64]) -> Result<u64, GpuError> {
        // Like the driver: any handle bytes map (the first byte picks the "allocation").
        self.ipc_opens.fetch_add(1, Ordering::Relaxed);
        Ok(0x7000_0000 + ((handle[0] as u64) << 24))
    }
    unsafe fn ipc_close(&self, _: u64) -> Result<(), GpuError> {
        Ok(())
    }
    fn address_range(&self, ptr: u64) -> Result<(u64, u64), GpuError> {
        Ok((ptr, self.alloc_len))
    }
    unsafe fn host_register(&self, _: *mut u8, _: usize) -> Result<(), GpuError> {
        Ok(())
    }
    unsafe fn host_unregister(&self, _: *mut u8) -> Result<(), GpuError> {
        Ok(())
    }
    fn copy_kernel(&self, _: &()) -> Result<u64, GpuError> {
        Ok(1)
    }
    fn host_pointers_are_device_pointers(&self, _: &()) -> Result<bool, GpuError> {
        Ok(true)
    }
    unsafe fn launch_copy_kernel(&self, _: u64, descs: u64, n: u64, _: u32, _: u32, _: usize) -> Result<(), GpuError> {
        self.kernels.fetch_add(1, Ordering::Relaxed);
        if self.dry {
            return Ok(());
        }
        // SAFETY: `descs` is this process's memory from alloc_mapped holding `n` entries.
        let descs = unsafe { std::slice::from_raw_parts(descs as *const crate::gather::Desc, n as usize) };
        for d in descs {
            // SAFETY: the test's descriptors name its own live buffers.
            unsafe { std::ptr::copy_nonoverlapping(d.src as *const u8, d.dst as *mut u8, d.len as usize) };
        }
        Ok(())
    }
    fn alloc_mapped(&self, bytes: usize) -> Result<*mut u8, GpuError> {
        // SAFETY: plain allocation; freed in free_mapped.
        let p = unsafe { libc::aligned_alloc(4096, bytes.next_multiple_of(4096)) };
        if p.is_null() {
            return Err(GpuError::Unsupported("out of memory".into()));
        }
        Ok(p.cast())
    }
    fn alloc_device(&self, bytes: usize) -> Result<u64, GpuError> {
        Ok(self.alloc_mapped(bytes)? as u64)
    }
    unsafe fn free_device(&self, ptr: u64) {
        // SAFETY: from alloc_mapped in alloc_device.
        unsafe { self.free_mapped(ptr as *mut u8) };
    }
    fn wait_event(&self, _: usize, _: usize) -> Result<(), GpuError> {
        if self.events {
            Ok(())
        } else {
            Err(GpuError::Unsupported("SIM: events off".into()))
        }
    }
    fn join(&self, _: usize, _: usize, _: usize) -> Result<(), GpuError> {
        self.joins.fetch_add(1, Ordering::Relaxed);
        if self.events {
            Ok(())
        } else {
            Err(GpuError::Unsupported("SIM: events off".into()))
        }
    }
    unsafe fn free_mapped(&self, ptr: *mut u8) {
        // SAFETY: from aligned_alloc in alloc_mapped.
        unsafe { libc::free(ptr.cast()) };
    }
}

pub(super) fn simulated(fail_len: usize, events: bool, events_lag: bool) -> (SimulatedDevice, Engine<SimulatedDevice>) {
    let api = SimulatedDevice {
        fail_len,
        events,
        events_lag,
        copies: AtomicUsize::new(0),
        ipc_opens: AtomicUsize::new(0),
        syncs: AtomicUsize::new(0),
        kernels: AtomicUsize::new(0),
        streams_made: AtomicUsize::new(0),
        batches: Mutex::new(Vec::new()),
        batch_streams: Mutex::new(Vec::new()),
        joins: AtomicUsize::new(0),
        dry: false,
        alloc_len: 1 << 20,
    };
    let engine = Engine::new(0, [7; 16], (), false);
    (api, engine)
}
