//! The CUDA side of a worker child: its context, stream, kernels ([`umbp_gpu::testkit`]) and
//! contiguous-copy baselines.

use std::ffi::{c_void, CString};
use std::time::Instant;

use serde_json::{json, Value};
use umbp_gpu::cuda::sys::{self, CUcontext, CUdeviceptr, CUfunction, CUmodule, CUresult, CUstream};

use super::command::CopyDir;
use umbp_gpu::testkit::PTX;

fn ck(call: &str, r: CUresult) -> Result<(), String> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{call} failed: {r:?}"))
    }
}

pub struct Gpu {
    /// Device 0's primary context, current on the worker's thread.
    _ctx: CUcontext,
    pub stream: u64,
    pub name: String,
    module: Option<(CUfunction, CUfunction)>,
    bad: CUdeviceptr,
}

impl Gpu {
    pub fn new() -> Result<Self, String> {
        umbp_gpu::cuda::init().map_err(|e| e.to_string())?;
        let name = umbp_gpu::cuda::device_name(0).unwrap_or_default();
        let mut ctx: CUcontext = std::ptr::null_mut();
        let mut stream: CUstream = std::ptr::null_mut();
        let mut bad: CUdeviceptr = 0;
        // SAFETY: plain driver calls with out-pointers to locals; the primary context
        // of device 0 stays retained (and current on this thread) for the process.
        unsafe {
            let mut dev = 0;
            ck("cuDeviceGet", sys::cuDeviceGet(&mut dev, 0))?;
            ck("cuDevicePrimaryCtxRetain", sys::cuDevicePrimaryCtxRetain(&mut ctx, dev))?;
            ck("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx))?;
            ck("cuStreamCreate", sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32))?;
            ck("cuMemAlloc", sys::cuMemAlloc_v2(&mut bad, 8))?;
        }
        let module = Self::load_module().map_err(|e| eprintln!("worker: PTX kernels unavailable: {e}")).ok();
        Ok(Gpu { _ctx: ctx, stream: stream as u64, name, module, bad })
    }

    fn load_module() -> Result<(CUfunction, CUfunction), String> {
        let src = CString::new(PTX).expect("no NUL in PTX");
        let mut m: CUmodule = std::ptr::null_mut();
        let (mut f1, mut f2): (CUfunction, CUfunction) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: a NUL-terminated PTX image; out-pointers to locals; the module is
        // never unloaded (functions stay valid for the process).
        unsafe {
            ck("cuModuleLoadData", sys::cuModuleLoadData(&mut m, src.as_ptr().cast()))?;
            ck("cuModuleGetFunction(spin_fill)", sys::cuModuleGetFunction(&mut f1, m, c"spin_fill".as_ptr()))?;
            ck("cuModuleGetFunction(check_pattern)", sys::cuModuleGetFunction(&mut f2, m, c"check_pattern".as_ptr()))?;
        }
        Ok((f1, f2))
    }

    fn cs(&self) -> CUstream {
        self.stream as CUstream
    }

    pub fn alloc(&self, len: usize) -> Result<u64, String> {
        let mut p: CUdeviceptr = 0;
        // SAFETY: out-pointer to a local; never freed (the pool may hold an IPC
        // mapping of it until this process exits).
        ck("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut p, len) })?;
        Ok(p)
    }

    /// Copies `src` to `dst` and waits until the bytes are in device memory.
    pub fn htod(&self, dst: u64, src: &[u8]) -> Result<(), String> {
        // SAFETY: `dst..+len` lies in one of our allocations (callers check), `src` is
        // a live slice.
        ck("cuMemcpyHtoD", unsafe { sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len()) })?;
        Self::settle()
    }

    pub fn dtoh(&self, src: u64, len: usize) -> Result<Vec<u8>, String> {
        let mut v = vec![0u8; len];
        // SAFETY: as htod, reversed.
        ck("cuMemcpyDtoH", unsafe { sys::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), src, len) })?;
        Ok(v)
    }

    /// Sets `len` bytes at `dst` to `byte` and waits until they are set.
    pub fn memset(&self, dst: u64, byte: u8, len: usize) -> Result<(), String> {
        // SAFETY: inside one of our allocations.
        ck("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(dst, byte, len) })?;
        Self::settle()
    }

    /// Waits for this context's work on the legacy stream: a memset of device memory, and
    /// a copy from pageable memory past its staging, may still run when their (so-called
    /// synchronous) calls return (CUDA's "API synchronization behavior"), and the pool
    /// copies this memory next from another process, ordered by nothing else. (A load
    /// into poisoned memory once found a page still poisoned on the H200: the memset landed
    /// after the pool's copy, the pool polling and so copying at once.)
    fn settle() -> Result<(), String> {
        // SAFETY: no arguments; the context is current on this thread (`new`).
        ck("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    pub fn sync(&self) -> Result<(), String> {
        // SAFETY: our live stream.
        ck("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(self.cs()) })
    }

    fn launch(&self, f: CUfunction, args: &mut [u64; 4]) -> Result<(), String> {
        let mut params: Vec<*mut c_void> = args.iter_mut().map(|a| (a as *mut u64).cast()).collect();
        // SAFETY: the kernel takes four 8-byte parameters, pointed to by `params`,
        // which outlive the call (the driver copies them at launch).
        ck("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(f, 264, 1, 1, 256, 1, 1, 0, self.cs(), params.as_mut_ptr(), std::ptr::null_mut())
        })
    }

    /// Enqueues (without waiting) the slow kernel that writes pattern `seed`.
    pub fn spin_fill(&self, ptr: u64, len: usize, seed: u64, spin_ns: u64) -> Result<(), String> {
        let (f, _) = self.module.ok_or("PTX kernels unavailable")?;
        self.launch(f, &mut [ptr, (len / 8) as u64, seed, spin_ns])
    }

    /// Enqueues the checking kernel right away, then waits for the stream; returns the
    /// number of words that differed from pattern `seed` when the kernel read them.
    pub fn check_pattern(&self, ptr: u64, len: usize, seed: u64) -> Result<u64, String> {
        let (_, f) = self.module.ok_or("PTX kernels unavailable")?;
        // SAFETY: our 8-byte counter, reset asynchronously in stream order.
        ck("cuMemsetD8Async", unsafe { sys::cuMemsetD8Async(self.bad, 0, 8, self.cs()) })?;
        self.launch(f, &mut [ptr, (len / 8) as u64, seed, self.bad])?;
        self.sync()?;
        let v = self.dtoh(self.bad, 8)?;
        Ok(u64::from_le_bytes(v.try_into().expect("8 bytes")))
    }

    /// Median time of a contiguous pinned copy of `bytes` (`D2h`, `H2d`, or `Bidir`:
    /// both at once on two streams).
    pub fn baseline(&self, bytes: usize, dir: CopyDir, reps: usize) -> Result<u64, String> {
        let mut host: *mut c_void = std::ptr::null_mut();
        let mut dev: CUdeviceptr = 0;
        let mut host2: *mut c_void = std::ptr::null_mut();
        let mut dev2: CUdeviceptr = 0;
        let mut s2: CUstream = std::ptr::null_mut();
        let bidir = dir == CopyDir::Bidir;
        // SAFETY: allocations of `bytes` each, freed below; copies stay inside them.
        unsafe {
            ck("cuMemAllocHost", sys::cuMemAllocHost_v2(&mut host, bytes))?;
            ck("cuMemAlloc", sys::cuMemAlloc_v2(&mut dev, bytes))?;
            if bidir {
                ck("cuMemAllocHost", sys::cuMemAllocHost_v2(&mut host2, bytes))?;
                ck("cuMemAlloc", sys::cuMemAlloc_v2(&mut dev2, bytes))?;
                ck("cuStreamCreate", sys::cuStreamCreate(&mut s2, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32))?;
            }
            std::ptr::write_bytes(host.cast::<u8>(), 1, bytes);
        }
        let mut times = Vec::new();
        for _ in 0..reps + 1 {
            let t = Instant::now();
            // SAFETY: the buffers above, `bytes` long.
            unsafe {
                match dir {
                    CopyDir::H2d => ck("cuMemcpyHtoDAsync", sys::cuMemcpyHtoDAsync_v2(dev, host, bytes, self.cs()))?,
                    _ => ck("cuMemcpyDtoHAsync", sys::cuMemcpyDtoHAsync_v2(host, dev, bytes, self.cs()))?,
                }
                if bidir {
                    ck("cuMemcpyHtoDAsync", sys::cuMemcpyHtoDAsync_v2(dev2, host2, bytes, s2))?;
                    ck("cuStreamSynchronize", sys::cuStreamSynchronize(s2))?;
                }
            }
            self.sync()?;
            times.push(t.elapsed().as_nanos() as f64);
        }
        times.remove(0);
        // SAFETY: frees what was allocated above; nothing is in flight.
        unsafe {
            sys::cuMemFreeHost(host);
            sys::cuMemFree_v2(dev);
            if bidir {
                sys::cuMemFreeHost(host2);
                sys::cuMemFree_v2(dev2);
                sys::cuStreamDestroy_v2(s2);
            }
        }
        Ok(super::median(times) as u64)
    }

    /// Contiguous pinned device-to-host copies for `seconds` (interference baseline).
    pub fn memcpy_loop(&self, bytes: usize, seconds: f64) -> Result<Value, String> {
        let mut host: *mut c_void = std::ptr::null_mut();
        let mut dev: CUdeviceptr = 0;
        // SAFETY: as in baseline.
        unsafe {
            ck("cuMemAllocHost", sys::cuMemAllocHost_v2(&mut host, bytes))?;
            ck("cuMemAlloc", sys::cuMemAlloc_v2(&mut dev, bytes))?;
        }
        let t = Instant::now();
        let mut moved = 0u64;
        while t.elapsed().as_secs_f64() < seconds {
            // SAFETY: the buffers above.
            unsafe { ck("cuMemcpyDtoHAsync", sys::cuMemcpyDtoHAsync_v2(host, dev, bytes, self.cs()))? };
            self.sync()?;
            moved += bytes as u64;
        }
        let ns = t.elapsed().as_nanos() as u64;
        // SAFETY: frees the buffers above; nothing in flight.
        unsafe {
            sys::cuMemFreeHost(host);
            sys::cuMemFree_v2(dev);
        }
        Ok(json!({"ns": ns, "bytes": moved}))
    }
}
