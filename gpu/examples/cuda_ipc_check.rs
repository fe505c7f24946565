//! End-to-end check of the CUDA backend on a GPU machine, in two real processes:
//!
//! 1. a child ("worker") allocates device memory, fills it with a pattern and exports it
//!    with `export_cuda_memory` (cuIpcGetMemHandle);
//! 2. the parent ("pool") registers page-aligned DRAM in chunks, opens the IPC handle
//!    through `backend_for(MemoryKind::Cuda)`, copies the pattern out in 64 KiB pages and
//!    checks it byte for byte, writes a second pattern back and has the child check it;
//! 3. it measures GB/s of large copies both ways (one op per chunk, and 64 KiB pages)
//!    against a plain `cuMemcpyDtoH/HtoD` of a local allocation as baseline;
//! 4. it checks the §7 fence helpers: a stream waiting on a pool word does not pass
//!    before the CPU writes it.
//!
//! Prints one JSON object per measurement and ends with `N passed, M failed`; exits non-zero
//! on any failure. Usage: `cuda_ipc_check [--mib N]` (default 1024). See docs/gpu.md.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Instant;

#[path = "../tests/common/mod.rs"]
mod common;

use common::{bind_primary_context, ck, reg_from_hex, PoolMem};
use umbp_gpu::cuda::{self, sys};
use umbp_gpu::{backend_for, CopyOp, MemoryKind, MemoryRegistration};

const OFFSET: u64 = 4096;
const PAGE: u64 = 64 * 1024;
const CHUNK: usize = 256 << 20;

/// Pattern `seed`, computed per 8-byte word so a GiB takes well under a second.
fn fill(buf: &mut [u8], seed: u64) {
    for (i, w) in buf.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&word(seed, i).to_le_bytes());
    }
}

fn word(seed: u64, i: usize) -> u64 {
    (i as u64 ^ seed.rotate_left(40)).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed
}

/// Index of the first wrong byte, if any.
fn mismatch(buf: &[u8], seed: u64) -> Option<usize> {
    buf.chunks_exact(8).enumerate().position(|(i, w)| w != word(seed, i).to_le_bytes()).map(|i| i * 8)
}

fn child(len: usize) {
    cuda::init().expect("CUDA");
    bind_primary_context();
    let mut host = vec![0u8; len];
    fill(&mut host, 1);
    let mut dptr: sys::CUdeviceptr = 0;
    // SAFETY: allocation and a copy into it, within its size.
    unsafe {
        ck("cuMemAlloc", sys::cuMemAlloc_v2(&mut dptr, len + 2 * OFFSET as usize));
        ck("cuMemcpyHtoD", sys::cuMemcpyHtoD_v2(dptr + OFFSET, host.as_ptr().cast(), len));
        // The pageable copy may still run when the call returns; the other process
        // reads this memory next.
        ck("cuCtxSynchronize", sys::cuCtxSynchronize());
    }
    let reg = cuda::export_cuda_memory(dptr + OFFSET, len as u64, 1).expect("export");
    let hex: String = bytemuck::bytes_of(&reg).iter().map(|b| format!("{b:02x}")).collect();
    println!("REG {hex}");
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let Some(seed) = line.strip_prefix("verify ") else {
            break;
        };
        // SAFETY: copies the registered range into `host`, which has `len` bytes.
        unsafe { ck("cuMemcpyDtoH", sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), dptr + OFFSET, len)) };
        match mismatch(&host, seed.parse().unwrap()) {
            None => println!("RESULT OK"),
            Some(i) => println!("RESULT BAD at byte {i}"),
        }
    }
}

struct Report {
    passed: u32,
    failed: u32,
}

impl Report {
    fn check(&mut self, case: &str, ok: bool, detail: &str) {
        println!("{{\"check\":\"cuda_ipc\",\"case\":\"{case}\",\"ok\":{ok},\"detail\":\"{detail}\"}}");
        if ok {
            self.passed += 1;
        } else {
            self.failed += 1;
        }
    }

    fn rate(&self, case: &str, bytes: usize, secs: f64, baseline: f64) {
        let gbps = bytes as f64 / secs / 1e9;
        println!(
            "{{\"bench\":\"cuda_ipc\",\"case\":\"{case}\",\"value\":{gbps:.2},\"unit\":\"GB/s\",\"baseline\":{baseline:.2},\"baseline_name\":\"cuMemcpy of a local allocation\",\"speedup\":{:.2},\"bytes\":{bytes}}}",
            gbps / baseline
        );
    }
}

/// Best of `n` timed runs, in seconds.
fn best_of(n: usize, mut f: impl FnMut()) -> f64 {
    (0..n)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("child") {
        return child(args[2].parse().unwrap());
    }
    let mib: usize = match args.iter().position(|a| a == "--mib") {
        Some(i) => args[i + 1].parse().expect("--mib N"),
        None => 1024,
    };
    let len = (mib << 20).div_ceil(CHUNK) * CHUNK;
    let backend = match backend_for(MemoryKind::Cuda) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("cuda_ipc_check: {e}");
            std::process::exit(2);
        }
    };
    let n = cuda::device_count().unwrap();
    let uuid = cuda::device_uuid(0).unwrap();
    eprintln!("cuda_ipc_check: {n} device(s), device 0 uuid {uuid:02x?}, {} MiB", len >> 20);

    let exe = std::env::current_exe().unwrap();
    let mut peer =
        Command::new(exe).args(["child", &len.to_string()]).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("spawn child");
    let mut to_child = peer.stdin.take().unwrap();
    let mut from_child = BufReader::new(peer.stdout.take().unwrap());
    let mut read = |prefix: &str| -> String {
        let mut line = String::new();
        from_child.read_line(&mut line).unwrap();
        line.trim().strip_prefix(prefix).unwrap_or_else(|| panic!("child said {line:?}")).trim().to_string()
    };
    let reg: MemoryRegistration = reg_from_hex(&read("REG"));

    // Pool DRAM: page aligned, registered in chunks like the pool's background thread does.
    let mem = PoolMem::new(len);
    let pool = mem.ptr();
    // SAFETY: the mapping lives until munmap below; the slice is only used between copies.
    let pool_slice = unsafe { std::slice::from_raw_parts_mut(pool, len) };
    let t = Instant::now();
    for c in (0..len).step_by(CHUNK) {
        // SAFETY: each chunk lies in the mapping, which outlives the registration.
        unsafe { backend.register_host_memory(pool.add(c), CHUNK) }.unwrap();
    }
    eprintln!("cuda_ipc_check: registered {} MiB in {:.2}s", len >> 20, t.elapsed().as_secs_f64());

    let mut report = Report { passed: 0, failed: 0 };
    let region = backend.open_region(&reg, None, peer.id()).unwrap();
    report.check("open_region", region.len() == len as u64, "IPC handle opened in the pool process");

    // Functional: pages out in reverse order, checked byte for byte.
    let pages = len as u64 / PAGE;
    let reversed: Vec<CopyOp> =
        (0..pages).map(|p| CopyOp { alloc_id: 1, device_offset: p * PAGE, host_offset: (pages - 1 - p) * PAGE, len: PAGE }).collect();
    // SAFETY: every host range lies in the pool mapping.
    unsafe { region.copy_to_host(&reversed, pool) }.unwrap();
    let mut bad = None;
    for p in 0..pages as usize {
        let dst = &pool_slice[(pages as usize - 1 - p) * PAGE as usize..][..PAGE as usize];
        let first_word = p * PAGE as usize / 8;
        if let Some(i) = dst.chunks_exact(8).enumerate().position(|(i, w)| w != word(1, first_word + i).to_le_bytes()) {
            bad = Some((p, i * 8));
            break;
        }
    }
    report.check("device_to_host_pages", bad.is_none(), &format!("{pages} pages of 64 KiB, reversed; first bad {bad:?}"));

    fill(pool_slice, 2);
    let straight: Vec<CopyOp> =
        (0..pages).map(|p| CopyOp { alloc_id: 1, device_offset: p * PAGE, host_offset: p * PAGE, len: PAGE }).collect();
    // SAFETY: as above.
    unsafe { region.copy_from_host(&straight, pool) }.unwrap();
    writeln!(to_child, "verify 2").unwrap();
    let answer = read("RESULT");
    report.check("host_to_device_pages", answer == "OK", &answer);

    // Bandwidth. One op per registered chunk (never straddling two registrations).
    let chunk_ops: Vec<CopyOp> = (0..len / CHUNK)
        .map(|c| CopyOp { alloc_id: 1, device_offset: (c * CHUNK) as u64, host_offset: (c * CHUNK) as u64, len: CHUNK as u64 })
        .collect();
    bind_primary_context();
    let mut local: sys::CUdeviceptr = 0;
    // SAFETY: a local allocation of `len` bytes used only for the baseline copies.
    unsafe { ck("cuMemAlloc", sys::cuMemAlloc_v2(&mut local, len)) };
    // One copy per registered chunk: a copy spanning two separate registrations is
    // refused by the driver (CUDA_ERROR_INVALID_VALUE on the H200).
    // SAFETY: copies between the local allocation and the registered pool, both `len`.
    let base_d2h = len as f64
        / best_of(3, || unsafe {
            for c in (0..len).step_by(CHUNK) {
                ck("cuMemcpyDtoH", sys::cuMemcpyDtoH_v2(pool.add(c).cast(), local + c as u64, CHUNK))
            }
        })
        / 1e9;
    // SAFETY: as above.
    let base_h2d = len as f64
        / best_of(3, || unsafe {
            for c in (0..len).step_by(CHUNK) {
                ck("cuMemcpyHtoD", sys::cuMemcpyHtoD_v2(local + c as u64, pool.add(c).cast(), CHUNK))
            }
        })
        / 1e9;
    let runs: [(&str, &[CopyOp], bool, f64); 4] = [
        ("d2h_large_ops", &chunk_ops, true, base_d2h),
        ("h2d_large_ops", &chunk_ops, false, base_h2d),
        ("d2h_64k_pages", &reversed, true, base_d2h),
        ("h2d_64k_pages", &straight, false, base_h2d),
    ];
    for (case, ops, to_host, baseline) in runs {
        let secs = best_of(3, || {
            // SAFETY: every op's host range lies in the pool mapping.
            let r = unsafe {
                if to_host {
                    region.copy_to_host(ops, pool)
                } else {
                    region.copy_from_host(ops, pool)
                }
            };
            r.unwrap()
        });
        report.rate(case, len, secs, baseline);
    }
    // SAFETY: the baseline allocation is no longer used.
    unsafe { ck("cuMemFree", sys::cuMemFree_v2(local)) };

    // Fences (umbp_gpu::fence): a stream waits on one pool word, then writes another.
    // SAFETY: both words lie in the registered pool; the stream is synchronized before the
    // words are reused; the CPU side uses volatile accesses because the GPU writes behind
    // the compiler's back.
    let fence_ok = unsafe {
        let gate = pool.cast::<u64>();
        let done = pool.add(64).cast::<u64>();
        gate.write_volatile(0);
        done.write_volatile(0);
        let mut stream = std::ptr::null_mut();
        ck("cuStreamCreate", sys::cuStreamCreate(&mut stream, 1));
        let gate_d = cuda::host_device_pointer(gate.cast()).unwrap();
        let done_d = cuda::host_device_pointer(done.cast()).unwrap();
        cuda::stream_wait_value64(stream, gate_d, 1).unwrap();
        cuda::stream_write_value64(stream, done_d, 7).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(100));
        let early = done.read_volatile();
        gate.write_volatile(1);
        ck("cuStreamSynchronize", sys::cuStreamSynchronize(stream));
        let late = done.read_volatile();
        ck("cuStreamDestroy", sys::cuStreamDestroy_v2(stream));
        (early, late)
    };
    report.check("stream_fences", fence_ok == (0, 7), &format!("done word before/after gate: {fence_ok:?}"));

    drop(region);
    for c in (0..len).step_by(CHUNK) {
        // SAFETY: registered above; no copy in flight.
        unsafe { backend.unregister_host_memory(pool.add(c)) }.unwrap();
    }
    drop(mem);
    drop(to_child);
    let _ = peer.wait();
    println!("{} passed, {} failed", report.passed, report.failed);
    if report.failed > 0 {
        std::process::exit(1);
    }
}
