//! The page copy kernel path (issue #14) on a real GPU: byte-exact gather/scatter of small
//! pages, fence ordering identical to the copy-engine path, and the per-GPU calibration.
//! In one process (the region is opened in-process, as in embedded mode); the
//! cross-process checks (two workers, a worker killed mid-transfer) run in
//! `umbp-bench transfer --check --gather kernel`. Without a GPU every test prints why it is
//! skipped (with `UMBP_REQUIRE_CUDA=1` a missing GPU fails instead).

mod common;

use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard};

use common::{bind_primary_context, ck, cuda_or_skip, pattern, PoolMem};
use umbp_gpu::cuda::{self, sys};
use umbp_gpu::fence::FenceWord;
use umbp_gpu::gather::{calibrations, kernel_launches};
use umbp_gpu::testkit::{pattern_word, PTX};
use umbp_gpu::{Backend, CopyOp, DeviceRegion, Dir, EngineConfig, Fence, GatherMode, Part, TransferArgs};

/// The tests change the process-wide gather mode: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Device memory of this process, registered with the backend in-process, plus registered
/// pool memory.
struct Setup {
    backend: Arc<dyn Backend>,
    dptr: u64,
    dev_len: usize,
    region: Box<dyn DeviceRegion>,
    pool: PoolMem,
    pool_len: usize,
    /// Page copy path every transfer of this setup passes in its EngineConfig.
    mode: std::cell::Cell<GatherMode>,
}

impl Setup {
    fn new(backend: Arc<dyn Backend>, dev_len: usize, pool_len: usize, mode: GatherMode) -> Setup {
        bind_primary_context();
        let mut dptr: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer to a local.
        unsafe { ck("cuMemAlloc", sys::cuMemAlloc_v2(&mut dptr, dev_len)) };
        let reg = cuda::export_cuda_memory(dptr, dev_len as u64, 7).unwrap();
        let region = backend.open_region(&reg, None, std::process::id()).unwrap();
        // +4 KiB: the fence word lives in the last page.
        let pool = PoolMem::new(pool_len + 4096);
        // SAFETY: the range is `pool`, alive until Drop unregisters it.
        unsafe { backend.register_host_memory(pool.ptr(), pool_len + 4096) }.unwrap();
        Setup { backend, dptr, dev_len, region, pool, pool_len, mode: std::cell::Cell::new(mode) }
    }

    fn upload(&self, bytes: &[u8]) {
        // SAFETY: `bytes` fits the allocation (callers pass dev_len bytes at most).
        // (The pageable copy may still run when the call returns; the engine's
        // non-blocking streams do not wait for the legacy stream.)
        unsafe {
            ck("cuMemcpyHtoD", sys::cuMemcpyHtoD_v2(self.dptr, bytes.as_ptr().cast(), bytes.len()));
            ck("cuCtxSynchronize", sys::cuCtxSynchronize());
        }
    }

    fn download(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.dev_len];
        // SAFETY: the whole allocation into a buffer of its size.
        unsafe { ck("cuMemcpyDtoH", sys::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), self.dptr, self.dev_len)) };
        v
    }

    /// The fence word: the last 8-byte slot of the registered pool memory.
    fn fence_word(&self) -> FenceWord<'_> {
        // SAFETY: inside `pool`, registered device-mapped; lives as long as self.
        unsafe {
            let host = self.pool.ptr().add(self.pool_len);
            let dev = cuda::host_device_pointer(host).unwrap();
            (host as *mut u64).write_volatile(0);
            FenceWord::new(host.cast(), Some(dev))
        }
    }

    fn transfer(&self, to_host: bool, ops: &[CopyOp], fence: Fence<'_>) {
        let parts = [Part { region: &*self.region, ops }];
        let dir = if to_host { Dir::DeviceToHost } else { Dir::HostToDevice };
        let mut engine = EngineConfig::default();
        engine.gather.mode = self.mode.get();
        let args = TransferArgs {
            dir,
            host_base: self.pool.ptr(),
            fence,
            fence_timeout: umbp_gpu::fence::FENCE_TIMEOUT,
            keep_waiting: &|| true,
            engine,
        };
        // SAFETY: every op's host range lies inside `pool` (callers build them so).
        let r = unsafe { umbp_gpu::transfer(&args, &parts) };
        r.into_iter().for_each(|r| r.unwrap());
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        // SAFETY: no copy is in flight; registered in new.
        unsafe {
            self.backend.unregister_host_memory(self.pool.ptr()).unwrap();
            ck("cuMemFree", sys::cuMemFree_v2(self.dptr));
        }
    }
}

/// `n` pages of `page` bytes: every other page-sized slot of the device, in reverse order
/// on the host (a kernel mixing up source and destination, or pages, shows).
fn pages(n: usize, page: usize) -> Vec<CopyOp> {
    (0..n)
        .map(|i| CopyOp { alloc_id: 7, device_offset: (2 * i * page) as u64, host_offset: ((n - 1 - i) * page) as u64, len: page as u64 })
        .collect()
}

#[test]
fn kernel_gather_and_scatter_are_byte_exact() {
    let _s = serial();
    let Some(backend) = cuda_or_skip() else { return };
    let dev_len = 64 << 20;
    let s = Setup::new(backend, dev_len, 32 << 20, GatherMode::Kernel);
    for (mode, page) in [
        (GatherMode::Kernel, 4096),
        (GatherMode::Kernel, 8192),
        (GatherMode::Kernel, 16384),
        // Not a multiple of the kernel's 4 KiB chunk: the 16-byte tail loop.
        (GatherMode::Kernel, 4096 + 48),
        (GatherMode::Kernel, 1 << 20),
        (GatherMode::CopyEngine, 4096),
        (GatherMode::Auto, 4096),
        (GatherMode::Auto, 65536),
        // Through device staging (the host side, reversed pages, is one contiguous run).
        (GatherMode::Staged, 4096),
        (GatherMode::Staged, 4096 + 48),
        (GatherMode::Staged, 16384),
    ] {
        s.mode.set(mode);
        let n = ((16 << 20) / page).min(dev_len / (2 * page));
        let ops = pages(n, page);
        let src: Vec<u8> = (0..dev_len).map(|i| pattern(3, i)).collect();
        s.upload(&src);
        let before = kernel_launches();
        let staged_before = umbp_gpu::gather::staging_stats().1;
        s.transfer(true, &ops, Fence::None);
        let staged_mid = umbp_gpu::gather::staging_stats().1;
        let staged_store = staged_mid > staged_before;
        let used_kernel = kernel_launches().0 > before.0;
        let host = s.pool.bytes();
        for (k, op) in ops.iter().enumerate() {
            let (h, d, len) = (op.host_offset as usize, op.device_offset as usize, op.len as usize);
            assert!(host[h..h + len] == src[d..d + len], "store {mode:?} page {page}: op {k} differs");
        }
        // Load: poisoned device, new pattern in the pool; gaps between pages stay poisoned.
        s.upload(&vec![0xEE; dev_len]);
        // SAFETY: writes the test's own pool memory while nothing copies.
        let pool = unsafe { std::slice::from_raw_parts_mut(s.pool.ptr(), s.pool_len) };
        pool.iter_mut().enumerate().for_each(|(i, b)| *b = pattern(9, i));
        s.transfer(false, &ops, Fence::None);
        let dev = s.download();
        let mut expect = vec![0xEE; dev_len];
        for op in &ops {
            let (h, d, len) = (op.host_offset as usize, op.device_offset as usize, op.len as usize);
            expect[d..d + len].copy_from_slice(&pool[h..h + len]);
        }
        let first_bad = dev.iter().zip(&expect).position(|(a, b)| a != b);
        assert_eq!(first_bad, None, "load {mode:?} page {page}: device byte differs");
        let staged = staged_store && umbp_gpu::gather::staging_stats().1 > staged_mid;
        println!("{mode:?} {page} B x {n}: byte-exact both ways, kernel used: {used_kernel}, staged: {staged}");
        match mode {
            GatherMode::Kernel => assert!(used_kernel, "forced kernel path did not launch"),
            GatherMode::Staged => assert!(staged_store && staged, "staged mode did not stage both ways"),
            GatherMode::CopyEngine => assert!(!used_kernel, "copy engines forced but the kernel ran"),
            GatherMode::Auto => {}
        }
    }
    for (ordinal, c) in calibrations() {
        println!(
            "calibration GPU {ordinal}: blocks {} d2h kernel up to {} B, h2d kernel up to {} B",
            c.blocks, c.d2h_crossover, c.h2d_crossover
        );
        for p in c.points {
            println!(
                "  page {:>6} B: d2h copy engines {:5.1} GB/s kernel {:5.1} | h2d copy engines {:5.1} kernel {:5.1}",
                p.page, p.d2h_ce_gbps, p.d2h_kernel_gbps, p.h2d_ce_gbps, p.h2d_kernel_gbps
            );
        }
    }
}

/// The worker's side: its own stream and the two kernels.
struct Worker {
    stream: sys::CUstream,
    spin: sys::CUfunction,
    check: sys::CUfunction,
    bad: u64,
}

impl Worker {
    fn new() -> Worker {
        let src = std::ffi::CString::new(PTX).unwrap();
        let mut w = Worker { stream: std::ptr::null_mut(), spin: std::ptr::null_mut(), check: std::ptr::null_mut(), bad: 0 };
        let mut m: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: plain driver calls with out-pointers to fields/locals; a context is current.
        unsafe {
            ck("cuStreamCreate", sys::cuStreamCreate(&mut w.stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32));
            ck("cuModuleLoadData", sys::cuModuleLoadData(&mut m, src.as_ptr().cast()));
            ck("spin_fill", sys::cuModuleGetFunction(&mut w.spin, m, c"spin_fill".as_ptr()));
            ck("check_pattern", sys::cuModuleGetFunction(&mut w.check, m, c"check_pattern".as_ptr()));
            ck("cuMemAlloc", sys::cuMemAlloc_v2(&mut w.bad, 8));
            ck("cuMemsetD8", sys::cuMemsetD8_v2(w.bad, 0, 8));
            // (A memset may still run when its call returns; `w.stream` does not wait.)
            ck("cuCtxSynchronize", sys::cuCtxSynchronize());
        }
        w
    }

    fn launch(&self, f: sys::CUfunction, mut args: [u64; 4]) {
        let mut params: Vec<*mut c_void> = args.iter_mut().map(|a| (a as *mut u64).cast()).collect();
        // SAFETY: four 8-byte parameters; buffers named by the caller are live allocations.
        ck("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(f, 264, 1, 1, 256, 1, 1, 0, self.stream, params.as_mut_ptr(), std::ptr::null_mut())
        });
    }

    fn sync(&self) {
        // SAFETY: our stream.
        ck("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(self.stream) });
    }
}

/// The fence tests' start: the serial lock, a kernel-path setup over 16 MiB of zeroed device
/// memory and 8 MiB of pool, and the worker's stream and kernels; None without a GPU.
fn fenced_setup() -> Option<(MutexGuard<'static, ()>, Setup, Worker)> {
    let guard = serial();
    let s = Setup::new(cuda_or_skip()?, 16 << 20, 8 << 20, GatherMode::Kernel);
    let w = Worker::new();
    s.upload(&vec![0u8; s.dev_len]);
    Some((guard, s, w))
}

/// Store fence: the worker's slow kernel writes the pages, then its stream writes the fence
/// word; the pool's kernel-path store, started at once, must read the kernel's bytes.
#[test]
fn kernel_path_fenced_store_after_a_slow_kernel() {
    let Some((_s, s, w)) = fenced_setup() else { return };
    let dev_len = s.dev_len;
    let word = s.fence_word();
    let seed = 0x5eed;
    w.launch(w.spin, [s.dptr, (dev_len / 8) as u64, seed, 300_000_000]);
    // SAFETY: the fence word stays mapped (inside `s.pool`) until the stream passed it.
    unsafe { cuda::fence_write(w.stream as u64, word.device().unwrap(), 1) }.unwrap();
    let ops = pages((8 << 20) / 4096, 4096);
    let before = kernel_launches().0;
    let t = std::time::Instant::now();
    s.transfer(true, &ops, Fence::WaitBefore(word, 1));
    let waited = t.elapsed();
    assert!(kernel_launches().0 > before, "kernel path not used");
    w.sync();
    let host = s.pool.bytes();
    for op in &ops {
        for j in (0..op.len).step_by(8) {
            let d = op.device_offset + j;
            let got = u64::from_le_bytes(host[(op.host_offset + j) as usize..][..8].try_into().unwrap());
            assert_eq!(got, pattern_word(seed, d / 8), "byte {} of the device read before the slow kernel wrote it", d);
        }
    }
    println!("fenced store after a 300 ms kernel: byte-exact, store call took {waited:?}");
}

/// Load fence: the worker's reading kernel waits on the fence word before it runs; the
/// pool's kernel-path load writes the word after its pages landed, so the reading kernel
/// sees every byte.
#[test]
fn kernel_path_fenced_load_before_a_reading_kernel() {
    let Some((_s, s, w)) = fenced_setup() else { return };
    let dev_len = s.dev_len;
    let word = s.fence_word();
    let seed = 0xfeed;
    // Pages cover the first 16 MiB of the device every other slot: fill the pool so that
    // after the scatter the device's slots hold the pattern, and check only those words.
    let page = 4096usize;
    let ops = pages((8 << 20) / page, page);
    // SAFETY: the test's own pool memory, nothing copies yet.
    let pool = unsafe { std::slice::from_raw_parts_mut(s.pool.ptr(), s.pool_len) };
    for op in &ops {
        for j in (0..op.len).step_by(8) {
            let v = pattern_word(seed, (op.device_offset + j) / 8);
            pool[(op.host_offset + j) as usize..][..8].copy_from_slice(&v.to_le_bytes());
        }
    }
    // The reading kernel checks the whole buffer: the gaps between pages get the pattern
    // now, the pages (zeroed) get it only from the load.
    let mut full = vec![0u8; dev_len];
    for i in 0..dev_len / 8 {
        full[i * 8..][..8].copy_from_slice(&pattern_word(seed, i as u64).to_le_bytes());
    }
    for op in &ops {
        full[op.device_offset as usize..][..op.len as usize].fill(0);
    }
    s.upload(&full);
    // SAFETY: the fence word stays mapped until the worker's stream passed the wait.
    unsafe { cuda::fence_wait(w.stream as u64, word.device().unwrap(), 1) }.unwrap();
    w.launch(w.check, [s.dptr, (dev_len / 8) as u64, seed, w.bad]);
    std::thread::sleep(std::time::Duration::from_millis(50));
    let before = kernel_launches().0;
    s.transfer(false, &ops, Fence::SignalAfter(word, 1));
    word.signal(1);
    assert!(kernel_launches().0 > before, "kernel path not used");
    w.sync();
    let mut bad = 0u64;
    // SAFETY: 8 bytes into a local.
    unsafe { ck("cuMemcpyDtoH", sys::cuMemcpyDtoH_v2((&mut bad as *mut u64).cast(), w.bad, 8)) };
    assert_eq!(bad, 0, "the reading kernel saw {bad} words before the load landed");
    println!("fenced load before a reading kernel: 0 stale words");
}
