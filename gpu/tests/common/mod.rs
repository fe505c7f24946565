//! Helpers for tests that need a real second process: the test binary re-executes itself
//! to run one "child" test function, and the two talk over the child's stdin/stdout. Also
//! what the child's memory and the pool's stand-in memory hold, and the checks the device
//! backends' tests (cuda.rs, hip.rs) share.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use std::sync::Arc;

use umbp_gpu::cuda::{self, sys};
use umbp_gpu::{backend_for, Backend, CopyOp, GpuError, MemoryKind, MemoryRegistration};

/// Set in the environment of a re-executed test binary; child entry points do nothing
/// without it, so they pass trivially in a normal run.
pub const CHILD_ENV: &str = "UMBP_GPU_TEST_CHILD";

pub fn is_child() -> bool {
    std::env::var_os(CHILD_ENV).is_some()
}

pub struct Peer {
    pub child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Peer {
    /// Runs test `entry` of this same binary in a new process.
    pub fn spawn(entry: &str) -> Peer {
        let exe = std::env::current_exe().expect("current_exe");
        let mut child = Command::new(exe)
            .args([entry, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn child test process");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Peer { child, stdin, stdout }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What follows `prefix` on the next line of the child that has it (libtest prints its
    /// own text around ours).
    pub fn expect(&mut self, prefix: &str) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.stdout.read_line(&mut line).expect("read child stdout");
            assert!(n > 0, "child exited before printing {prefix:?}");
            // libtest may print "test name ... " in front of the child's first line.
            let tag = format!("{prefix} ");
            if let Some(at) = line.find(&tag) {
                return line[at + tag.len()..].trim().to_string();
            }
        }
    }

    pub fn send(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").expect("write to child");
        self.stdin.flush().unwrap();
    }

    /// Asks the child to check its buffer against pattern `seed`.
    pub fn verify(&mut self, seed: u8) -> String {
        self.send(&format!("verify {seed}"));
        self.expect("RESULT")
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Child side: reads commands from stdin until EOF or `exit`; `verify <seed>` calls
/// `check(seed)` and prints `RESULT <its answer>`.
pub fn serve(mut check: impl FnMut(u8) -> String) {
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let line = line.unwrap();
        let mut words = line.split_whitespace();
        match words.next() {
            Some("verify") => {
                let seed: u8 = words.next().unwrap().parse().unwrap();
                println!("RESULT {}", check(seed));
            }
            Some("exit") | None => return,
            Some(other) => panic!("unknown command {other}"),
        }
    }
}

/// Byte `i` of test pattern `seed`: varies with both so a shifted or stale copy shows.
pub fn pattern(seed: u8, i: usize) -> u8 {
    (i as u32).wrapping_mul(2_654_435_761).rotate_left(seed as u32 % 32).wrapping_add(seed as u32) as u8 ^ (i >> 12) as u8
}

pub fn fill(buf: &mut [u8], seed: u8) {
    buf.iter_mut().enumerate().for_each(|(i, b)| *b = pattern(seed, i));
}

/// `OK`, or the first mismatching index.
pub fn check(buf: &[u8], seed: u8) -> String {
    match buf.iter().enumerate().position(|(i, &b)| b != pattern(seed, i)) {
        None => "OK".into(),
        Some(i) => format!("BAD at {i}: {} != {}", buf[i], pattern(seed, i)),
    }
}

pub fn reg_to_hex(reg: &MemoryRegistration) -> String {
    bytemuck::bytes_of(reg).iter().map(|b| format!("{b:02x}")).collect()
}

pub fn reg_from_hex(hex: &str) -> MemoryRegistration {
    let bytes: Vec<u8> = (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
    bytemuck::pod_read_unaligned(&bytes)
}

/// Page-aligned anonymous memory standing in for pool DRAM.
pub struct PoolMem {
    ptr: *mut u8,
    len: usize,
}

impl PoolMem {
    pub fn new(len: usize) -> PoolMem {
        // SAFETY: a fresh private anonymous mapping.
        let ptr = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        PoolMem { ptr: ptr.cast(), len }
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping lives as long as self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the mapping lives as long as self, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PoolMem {
    fn drop(&mut self) {
        // SAFETY: unmaps the mapping made in new.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// One op over the first `len` bytes of both registration `alloc_id` and the host memory.
pub fn op_from_start(alloc_id: u32, len: u64) -> CopyOp {
    CopyOp { alloc_id, device_offset: 0, host_offset: 0, len }
}

/// Ops that copy the first `len` bytes of registration `alloc_id` in 64 KiB pages to the
/// host memory from `host_base` on, in reverse page order, so that a copy mixing up the
/// offsets of its ops shows.
pub fn reversed_pages(alloc_id: u32, len: u64, host_base: u64) -> Vec<CopyOp> {
    let page = 64 * 1024u64;
    let pages = len / page;
    (0..pages).map(|p| CopyOp { alloc_id, device_offset: p * page, host_offset: host_base + (pages - 1 - p) * page, len: page }).collect()
}

/// After `ops` were copied to `host` from a registration holding pattern `seed`: asserts
/// that each op's host range holds the pattern at its device range.
pub fn assert_copied_to_host(host: &[u8], ops: &[CopyOp], seed: u8) {
    for (n, op) in ops.iter().enumerate() {
        let (dst, src) = (op.host_offset as usize, op.device_offset as usize);
        assert!((0..op.len as usize).all(|i| host[dst + i] == pattern(seed, src + i)), "op {n}");
    }
}

/// The device tests' check on a machine without the runtime library `lib` (e.g.
/// "libcuda"): given the backend's `init` result, a missing library must be named by it,
/// by `backend_for(kind)` and by the backend's `export`. With the library present this
/// path cannot be reached, and it says so.
pub fn check_missing_library_is_named(
    lib: &str,
    init: Result<(), GpuError>,
    kind: MemoryKind,
    export: fn(u64, u64, u32) -> Result<MemoryRegistration, GpuError>,
) {
    let file = format!("{lib}.so");
    match init {
        Ok(()) => eprintln!("{lib} present; the error path is not reachable here"),
        Err(e @ GpuError::LibraryMissing { .. }) => {
            assert!(e.to_string().contains(&file), "{e}");
            let err = backend_for(kind).err().unwrap();
            assert!(err.to_string().contains(&file), "{err}");
            let err = export(0x1000, 10, 1).unwrap_err();
            assert!(err.to_string().contains(&file), "{err}");
            eprintln!("SKIPPED the device tests: {e}");
        }
        Err(e) => eprintln!("{lib} present but unusable: {e}"),
    }
}

/// The CUDA backend, or None (with the reason printed) where there is no GPU. With
/// `UMBP_REQUIRE_CUDA=1` (set by scripts/device/gpu-check.sh) a missing GPU fails instead,
/// so a broken GPU machine cannot pass by skipping.
pub fn cuda_or_skip() -> Option<Arc<dyn Backend>> {
    let found = backend_for(MemoryKind::Cuda).and_then(|b| Ok((b, cuda::device_count()?)));
    let reason = match found {
        Ok((b, n)) if n > 0 => return Some(b),
        Ok(_) => "CUDA driver loaded but no device is visible".to_string(),
        Err(e) => format!("no usable CUDA driver: {e}"),
    };
    assert!(std::env::var_os("UMBP_REQUIRE_CUDA").is_none(), "UMBP_REQUIRE_CUDA is set but {reason}");
    eprintln!("SKIPPED: {reason}");
    None
}

/// Asserts that driver call `call` succeeded.
pub fn ck(call: &str, r: sys::CUresult) {
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{call}");
}

/// Device 0's primary context, retained for the rest of the process (the one the backend
/// uses too). The driver must be initialised.
pub fn retain_primary_context() -> sys::CUcontext {
    let (mut dev, mut ctx) = (0, std::ptr::null_mut());
    // SAFETY: plain driver calls with out-pointers to locals.
    unsafe {
        ck("cuDeviceGet", sys::cuDeviceGet(&mut dev, 0));
        ck("cuDevicePrimaryCtxRetain", sys::cuDevicePrimaryCtxRetain(&mut ctx, dev));
    }
    ctx
}

/// Device 0's primary context, made current on this thread (and retained for the process).
pub fn bind_primary_context() {
    let ctx = retain_primary_context();
    // SAFETY: a retained context.
    unsafe { ck("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx)) };
}
