//! The worker child of `transfer` (`__transfer-worker`): attaches to the pool, owns the KV
//! memory of each layout group (a host memfd or CUDA allocations), and runs the parent's
//! [`Command`]s one at a time, one JSON reply per command.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use umbp_worker::{BlockStatus, Completion, MemorySpec, ObjectKey, Segment, TransferId, Worker, WorkerConfig};

use super::command::{Command, CopyDir, Op, Shape, Xfer};
use super::{cu, median, BackendArg};

/// Pattern word `i` of seed `seed`; the PTX kernels compute the same.
pub(crate) use umbp_gpu::testkit::pattern_word as word;

const POISON: u8 = 0xEE;

enum Mem {
    Host(umbp_ipc::SharedMemory),
    Cuda { ptr: u64, len: usize },
}

impl Mem {
    fn len(&self) -> usize {
        match self {
            Mem::Host(m) => m.len(),
            Mem::Cuda { len, .. } => *len,
        }
    }
}

struct Group {
    shape: Shape,
    allocs: Vec<(u32, Mem)>,
    segments: Vec<Segment>,
    object_bytes: u64,
}

struct WorkerState {
    w: Worker,
    gpu: Option<cu::Gpu>,
    groups: std::collections::HashMap<u16, Group>,
    socket: PathBuf,
    namespace: u128,
    /// The index client of `Restore { keep_index: true }`, connected at the first.
    index: Option<umbp_scheduler::IndexClient>,
}

pub(crate) fn worker_main(socket: &Path, backend: BackendArg, namespace: u128) -> Result<(), String> {
    let gpu = match backend {
        BackendArg::Cuda => Some(cu::Gpu::new()?),
        BackendArg::Host => None,
    };
    let mut cfg = WorkerConfig::new(socket, namespace);
    cfg.timeout = Duration::from_secs(60);
    cfg.sq_entries = 1024;
    cfg.arena_bytes = 16 << 20;
    // For A/B runs of the completion wait (WorkerConfig::wait_poll); default: the worker's.
    if let Some(us) = std::env::var("UMBP_BENCH_WAIT_POLL_US").ok().and_then(|v| v.parse::<u64>().ok()) {
        cfg.wait_poll = Duration::from_micros(us);
    }
    let w = Worker::connect(cfg).map_err(|e| e.to_string())?;
    let mut st = WorkerState { w, gpu, groups: Default::default(), socket: socket.to_path_buf(), namespace, index: None };
    let out = std::io::stdout();
    let say = |v: Value| {
        let mut o = out.lock();
        let _ = writeln!(o, "{v}");
        let _ = o.flush();
    };
    say(json!({"ready": true}));
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| e.to_string())?;
        // A command this worker does not know (or a field it does not know) is answered
        // with an error naming it; the parent fails on it.
        let reply = match Command::parse(&line) {
            Ok(Command::Exit) => break,
            Ok(cmd) => st.handle(cmd, &say),
            Err(e) => Err(e),
        };
        say(reply.unwrap_or_else(|e| json!({"error": e})));
    }
    Ok(())
}

impl WorkerState {
    fn handle(&mut self, cmd: Command, say: &dyn Fn(Value)) -> Result<Value, String> {
        match cmd {
            Command::Info => Ok(json!({"gpu": self.gpu.as_ref().map(|g| g.name.clone()), "pid": std::process::id()})),
            Command::Setup { group, shape, seed } => self.setup(group, shape, seed),
            // Registrations stay (the pool keeps them until detach); memory is kept too
            // because the pool may still reference it. Only forget the layout locally.
            Command::Drop { .. } => Ok(json!({"ok": true})),
            Command::Reset => self.w.reset_namespace().map(|n| json!({"dropped": n})).map_err(|e| e.to_string()),
            Command::Xfer(x) => self.xfer(&x),
            Command::Baseline { bytes, dir, reps, threads } => self.baseline(bytes as usize, dir, reps.max(1), threads.max(1)),
            Command::Poison { group } => {
                let g = self.groups.get(&group).ok_or("no such group")?;
                for (_, m) in &g.allocs {
                    fill_poison(self.gpu.as_ref(), m)?;
                }
                Ok(json!({"ok": true}))
            }
            Command::Fill { group, seed } => {
                let g = self.groups.get(&group).ok_or("no such group")?;
                for (_, m) in &g.allocs {
                    fill_pattern(self.gpu.as_ref(), m, seed)?;
                }
                Ok(json!({"ok": true}))
            }
            Command::Verify { group, seed, blocks } => self.verify(group, seed, &blocks, false),
            Command::VerifyPoison { group, blocks } => self.verify(group, 0, &blocks, true),
            Command::VerifyAll { group, seed, blocks } => self.verify_all(group, seed, &blocks),
            Command::Restore { group, key_base, blocks, keep_index } => self.restore(group, key_base, &blocks, keep_index),
            Command::StoreLoop { group, key_base, blocks, seconds, no_reset } => {
                self.store_loop(group, key_base, &blocks, seconds, no_reset, say)
            }
            Command::MemcpyLoop { bytes, seconds } => {
                let gpu = self.gpu.as_ref().ok_or("memcpy_loop needs cuda")?;
                say(json!({"started": true}));
                gpu.memcpy_loop(bytes as usize, seconds)
            }
            Command::FenceStore { group, old_seed, new_seed, spin_ms, key_base, control_key_base } => {
                self.fence_store(group, old_seed, new_seed, spin_ms, key_base, control_key_base)
            }
            Command::FenceLoad { group, seed, key_base } => self.fence_load(group, seed, key_base),
            Command::Exit => Ok(json!({"ok": true})),
        }
    }

    fn setup(&mut self, group: u16, shape: Shape, seed: u64) -> Result<Value, String> {
        let Shape { layers, page, blocks, per_layer_alloc: per_layer, segments_per_layer: segs } = shape;
        if layers == 0 || page == 0 || blocks == 0 || !(1..=2).contains(&segs) {
            return Err(format!("setup: bad shape {shape:?}"));
        }
        // Per layer: `segs` regions of `blocks` pages (K pages, then V pages).
        let span = segs * blocks * page;
        let sizes: Vec<u64> = if per_layer { vec![span; layers as usize] } else { vec![layers * span] };
        let mut allocs = Vec::new();
        for (i, &len) in sizes.iter().enumerate() {
            let mem = match &self.gpu {
                Some(g) => Mem::Cuda { ptr: g.alloc(len as usize)?, len: len as usize },
                None => {
                    Mem::Host(umbp_ipc::SharedMemory::create(&format!("kv-{group}-{i}"), len as usize, false).map_err(|e| e.to_string())?)
                }
            };
            fill_pattern(self.gpu.as_ref(), &mem, seed)?;
            let spec = match &mem {
                Mem::Host(m) => MemorySpec::HostMemfd { fd: m.fd().try_clone_to_owned().map_err(|e| e.to_string())?, offset: 0, len },
                Mem::Cuda { ptr, len } => MemorySpec::Cuda { ptr: *ptr, len: *len as u64 },
            };
            // SAFETY: `mem` (a memfd or a CUDA allocation) is kept in `allocs` for as long as
            // the worker lives.
            let id = unsafe { self.w.register_memory(spec) }.map_err(|e| format!("register_memory: {e}"))?;
            allocs.push((id, mem));
        }
        let segments: Vec<Segment> = (0..layers)
            .flat_map(|l| (0..segs).map(move |s| (l, s)))
            .map(|(l, s)| {
                if per_layer {
                    Segment::new(allocs[l as usize].0, s * blocks * page, page, page, blocks)
                } else {
                    Segment::new(allocs[0].0, l * span + s * blocks * page, page, page, blocks)
                }
            })
            .collect();
        let object_bytes = self.w.register_layout(group, segments.clone()).map_err(|e| format!("register_layout: {e}"))?;
        self.groups.insert(group, Group { shape, allocs, segments, object_bytes });
        Ok(json!({"object_bytes": object_bytes}))
    }

    /// Submits `rounds` x `blocks` (keys `key_base + round * stride + i`) in transfers of
    /// `per_transfer` blocks with at most `inflight` outstanding; waits for all.
    fn xfer(&mut self, x: &Xfer) -> Result<Value, String> {
        let load = x.op == Op::Load;
        let (group, base, blocks, fence) = (x.group, x.key_base, &x.blocks, x.fence);
        let per = x.per_transfer.max(1);
        let inflight = x.inflight.max(1);
        let rounds = x.rounds.max(1);
        let stride = x.round_stride.unwrap_or(blocks.len() as u64);
        let stream = match (&self.gpu, fence) {
            (Some(g), true) => Some(g.stream),
            (None, true) => return Err("fenced transfers need cuda".into()),
            _ => None,
        };
        // Keys: `keys` (hex, one per block, e.g. per-rank keys) or `key_base + round * stride + i`.
        let explicit: Option<Vec<ObjectKey>> = match &x.keys {
            None => None,
            Some(k) => Some(
                k.iter()
                    .map(|h| u128::from_str_radix(h, 16).map(ObjectKey).map_err(|e| format!("xfer: key {h:?} is not hex: {e}")))
                    .collect::<Result<_, _>>()?,
            ),
        };
        if explicit.as_ref().is_some_and(|k| k.len() != blocks.len()) {
            return Err("xfer: `keys` must have one key per block".into());
        }
        let key = |r: u64, i: usize| match &explicit {
            Some(k) => k[i],
            None => ObjectKey((base + r * stride + i as u64) as u128),
        };
        let mut work: Vec<Vec<(ObjectKey, u64)>> = Vec::new();
        for r in 0..rounds {
            for chunk in blocks.iter().enumerate().collect::<Vec<_>>().chunks(per) {
                work.push(chunk.iter().map(|&(i, &b)| (key(r, i), b)).collect());
            }
        }
        let bytes = self.groups.get(&group).map_or(0, |g| g.object_bytes) * blocks.len() as u64 * rounds;
        let mut pending: std::collections::VecDeque<TransferId> = Default::default();
        let (mut ok, mut bad) = (0u64, 0u64);
        let mut statuses: std::collections::BTreeMap<String, u64> = Default::default();
        let mut tally = |c: Completion| {
            for s in &c.statuses {
                if s.is_ok() {
                    ok += 1;
                } else {
                    bad += 1;
                }
                *statuses.entry(format!("{s:?}")).or_default() += 1;
            }
            if let Some(e) = c.error {
                *statuses.entry(format!("error {e:?}")).or_default() += 1;
            }
        };
        let t = Instant::now();
        for job in &work {
            while pending.len() >= inflight {
                let id = pending.pop_front().expect("non-empty");
                tally(self.w.wait(id, Duration::from_secs(60)).ok_or("transfer timed out")?);
            }
            loop {
                let r = match (load, stream) {
                    (false, None) => self.w.store(group, job),
                    (true, None) => self.w.load(group, job),
                    (false, Some(s)) => self.w.store_after_stream(group, job, s),
                    (true, Some(s)) => self.w.load_before_stream(group, job, s),
                };
                match r {
                    Ok(id) => {
                        pending.push_back(id);
                        break;
                    }
                    Err(umbp_worker::WorkerError::Full) if !pending.is_empty() => {
                        let id = pending.pop_front().expect("non-empty");
                        tally(self.w.wait(id, Duration::from_secs(60)).ok_or("transfer timed out")?);
                    }
                    Err(e) => return Err(format!("submit: {e}")),
                }
            }
        }
        if let (Some(g), true) = (&self.gpu, fence && load) {
            // The stream passes its waits once every load landed: that is when the engine
            // could use the KV.
            g.sync()?;
        }
        let gpu_ns = t.elapsed().as_nanos() as u64;
        while let Some(id) = pending.pop_front() {
            tally(self.w.wait(id, Duration::from_secs(60)).ok_or("transfer timed out")?);
        }
        let ns = if fence && load { gpu_ns } else { t.elapsed().as_nanos() as u64 };
        Ok(json!({"ns": ns, "ok": ok, "bad": bad, "bytes": bytes, "statuses": statuses, "transfers": work.len()}))
    }

    fn baseline(&mut self, bytes: usize, dir: CopyDir, reps: usize, threads: usize) -> Result<Value, String> {
        let ns = match &self.gpu {
            Some(_) if threads != 1 => return Err("baseline: cuda copies are one cuMemcpy (threads must be 1)".into()),
            Some(g) => g.baseline(bytes, dir, reps)?,
            None => host_memcpy_ns(bytes, reps, threads),
        };
        Ok(json!({"ns": ns, "threads": threads}))
    }

    /// Counts words of `blocks`' pages that differ from the pattern `seed` (or from the
    /// poison byte).
    fn verify(&mut self, group: u16, seed: u64, blocks: &[u64], poison: bool) -> Result<Value, String> {
        let g = self.groups.get(&group).ok_or("no such group")?;
        let (mut words, mut bad) = (0u64, 0u64);
        let mut first_bad = Value::Null;
        for s in &g.segments {
            let mem = &g.allocs.iter().find(|(id, _)| *id == s.alloc_id).ok_or("segment alloc")?.1;
            for &b in blocks {
                let off = s.offset + b * s.block_stride;
                let bytes = read_mem(self.gpu.as_ref(), mem, off as usize, s.page_bytes as usize)?;
                for (j, w) in bytes.chunks_exact(8).enumerate() {
                    let i = off / 8 + j as u64;
                    let got = u64::from_le_bytes(w.try_into().expect("8 bytes"));
                    let want = if poison { u64::from_ne_bytes([POISON; 8]) } else { word(seed, i) };
                    words += 1;
                    if got != want {
                        if bad == 0 {
                            first_bad = json!({"alloc": s.alloc_id, "word": i, "got": format!("{got:#x}"), "want": format!("{want:#x}")});
                        }
                        bad += 1;
                    }
                }
            }
        }
        Ok(json!({"words": words, "bad_words": bad, "first_bad": first_bad}))
    }

    /// Every word of every allocation of `group`: pattern `seed` where the word lies in a
    /// page of one of `blocks`, poison elsewhere. Where a page lies is computed from the
    /// group's [`Shape`] alone (not from the segments registered with the pool), so a
    /// layout registered wrongly, or a load that writes outside its pages, shows up.
    fn verify_all(&mut self, group: u16, seed: u64, blocks: &[u64]) -> Result<Value, String> {
        const STEP: usize = 64 << 20;
        let g = self.groups.get(&group).ok_or("no such group")?;
        let shape = g.shape;
        let region = shape.blocks * shape.page;
        let span = shape.segments_per_layer * region;
        let mut wanted = vec![false; shape.blocks as usize];
        for &b in blocks {
            *wanted.get_mut(b as usize).ok_or_else(|| format!("block {b} outside the cache of {}", shape.blocks))? = true;
        }
        let poison = u64::from_ne_bytes([POISON; 8]);
        let (mut words, mut bad, mut loaded) = (0u64, 0u64, 0u64);
        let mut first_bad = Value::Null;
        for (id, mem) in &g.allocs {
            let mut off = 0usize;
            while off < mem.len() {
                let n = STEP.min(mem.len() - off);
                let bytes = read_mem(self.gpu.as_ref(), mem, off, n)?;
                for (j, w) in bytes.chunks_exact(8).enumerate() {
                    let o = (off + j * 8) as u64;
                    let b = (o % span % region) / shape.page;
                    let inside = wanted[b as usize];
                    let want = if inside { word(seed, o / 8) } else { poison };
                    let got = u64::from_le_bytes(w.try_into().expect("8 bytes"));
                    words += 1;
                    loaded += inside as u64;
                    if got != want {
                        if bad == 0 {
                            first_bad = json!({"alloc": id, "byte": o, "block": b, "in_prefix": inside, "got": format!("{got:#x}"), "want": format!("{want:#x}")});
                        }
                        bad += 1;
                    }
                }
                off += n;
            }
        }
        Ok(json!({"words": words, "bad_words": bad, "prefix_words": loaded, "first_bad": first_bad}))
    }

    /// Lookup through the scheduler's shared index, then load the hits; end to end.
    fn restore(&mut self, group: u16, base: u64, blocks: &[u64], keep_index: bool) -> Result<Value, String> {
        let keys: Vec<ObjectKey> = (0..blocks.len()).map(|i| ObjectKey((base + i as u64) as u128)).collect();
        let (socket, namespace) = (self.socket.clone(), self.namespace);
        let connect = move || umbp_scheduler::IndexClient::connect(&socket, namespace, Duration::from_secs(5)).map_err(|e| e.to_string());
        let mut fresh = None;
        let index = if keep_index {
            if self.index.is_none() {
                self.index = Some(connect()?);
            }
            self.index.as_mut().expect("connected")
        } else {
            fresh.insert(connect()?)
        };
        let t = Instant::now();
        let hits = index.match_prefix(&keys);
        let lookup_ns = t.elapsed().as_nanos() as u64;
        let job: Vec<(ObjectKey, u64)> = keys.iter().copied().zip(blocks.iter().copied()).take(hits).collect();
        let id = self.w.load(group, &job).map_err(|e| e.to_string())?;
        let submit_ns = t.elapsed().as_nanos() as u64 - lookup_ns;
        let c = self.w.wait(id, Duration::from_secs(60)).ok_or("restore timed out")?;
        let ns = t.elapsed().as_nanos() as u64;
        Ok(
            json!({"ns": ns, "lookup_ns": lookup_ns, "submit_ns": submit_ns, "hits": hits, "bad": c.statuses.iter().filter(|s| !s.is_ok()).count()}),
        )
    }

    /// Stores `blocks` with fresh keys in a loop for `seconds` (resetting the namespace
    /// when the pool fills), one transfer in flight; for interference and the kill check.
    fn store_loop(
        &mut self,
        group: u16,
        mut base: u64,
        blocks: &[u64],
        secs: f64,
        no_reset: bool,
        say: &dyn Fn(Value),
    ) -> Result<Value, String> {
        let ob = self.groups.get(&group).map_or(0, |g| g.object_bytes);
        say(json!({"started": true}));
        let t = Instant::now();
        let mut bytes = 0u64;
        while t.elapsed().as_secs_f64() < secs {
            let job: Vec<(ObjectKey, u64)> = blocks.iter().enumerate().map(|(i, &b)| (ObjectKey((base + i as u64) as u128), b)).collect();
            base += blocks.len() as u64;
            let id = self.w.store(group, &job).map_err(|e| e.to_string())?;
            let c = self.w.wait(id, Duration::from_secs(60)).ok_or("store timed out")?;
            let stored = c.statuses.iter().filter(|s| **s == BlockStatus::Stored).count() as u64;
            bytes += stored * ob;
            if stored < blocks.len() as u64 && !no_reset {
                self.w.reset_namespace().map_err(|e| e.to_string())?;
            }
        }
        Ok(json!({"ns": t.elapsed().as_nanos() as u64, "bytes": bytes}))
    }

    /// The fence checks' memory: group `group`'s first allocation (CUDA memory: pointer and
    /// length) and its blocks per segment.
    fn fenced_group(&self, group: u16) -> Result<(u64, usize, u64), String> {
        self.gpu.as_ref().ok_or("needs cuda")?;
        let g = self.groups.get(&group).ok_or("no such group")?;
        let Mem::Cuda { ptr, len } = &g.allocs[0].1 else { return Err("needs cuda memory".into()) };
        Ok((*ptr, *len, g.segments[0].num_blocks))
    }

    fn fence_store(&mut self, group: u16, old: u64, new: u64, spin_ms: u64, key_base: u64, control_key_base: u64) -> Result<Value, String> {
        let spin_ns = spin_ms * 1_000_000;
        let (ptr, len, n) = self.fenced_group(group)?;
        let job = |base: u64| -> Vec<(ObjectKey, u64)> { (0..n).map(|b| (ObjectKey((base + b) as u128), b)).collect() };
        let (gpu, g) = (self.gpu.as_ref().expect("checked"), &self.groups[&group]);
        // Fenced: the slow kernel writes `new` after spinning; the store is submitted at once.
        fill_pattern(Some(gpu), &g.allocs[0].1, old)?;
        let t = Instant::now();
        gpu.spin_fill(ptr, len, new, spin_ns)?;
        let id = self.w.store_after_stream(group, &job(key_base), gpu.stream).map_err(|e| e.to_string())?;
        let submit_us = t.elapsed().as_micros() as u64;
        let c = self.w.wait(id, Duration::from_secs(30)).ok_or("fenced store timed out")?;
        let done_ms = t.elapsed().as_millis() as u64;
        gpu.sync()?;
        // Control: the same without the fence.
        let gpu = self.gpu.as_ref().expect("checked");
        let g = self.groups.get(&group).expect("checked");
        fill_pattern(Some(gpu), &g.allocs[0].1, old)?;
        gpu.spin_fill(ptr, len, new, spin_ns)?;
        let id2 = self.w.store(group, &job(control_key_base)).map_err(|e| e.to_string())?;
        let c2 = self.w.wait(id2, Duration::from_secs(30)).ok_or("control store timed out")?;
        self.gpu.as_ref().expect("checked").sync()?;
        Ok(json!({"bad": c.statuses.iter().filter(|s| !s.is_ok()).count(), "submit_us": submit_us,
            "completed_after_ms": done_ms, "kernel_spin_ms": spin_ns / 1_000_000,
            "control_bad": c2.statuses.iter().filter(|s| !s.is_ok()).count()}))
    }

    fn fence_load(&mut self, group: u16, seed: u64, base: u64) -> Result<Value, String> {
        let (ptr, len, n) = self.fenced_group(group)?;
        let job: Vec<(ObjectKey, u64)> = (0..n).map(|b| (ObjectKey((base + b) as u128), b)).collect();
        let (gpu, g) = (self.gpu.as_ref().expect("checked"), &self.groups[&group]);
        fill_poison(Some(gpu), &g.allocs[0].1)?;
        let id = self.w.load_before_stream(group, &job, gpu.stream).map_err(|e| e.to_string())?;
        let gpu = self.gpu.as_ref().expect("checked");
        let bad_words = gpu.check_pattern(ptr, len, seed)?;
        let c = self.w.wait(id, Duration::from_secs(30)).ok_or("fenced load timed out")?;
        // Control: plain load, kernel launched right after the submission.
        let g = self.groups.get(&group).expect("checked");
        fill_poison(Some(gpu), &g.allocs[0].1)?;
        let id2 = self.w.load(group, &job).map_err(|e| e.to_string())?;
        let gpu = self.gpu.as_ref().expect("checked");
        let control_bad_words = gpu.check_pattern(ptr, len, seed)?;
        let c2 = self.w.wait(id2, Duration::from_secs(30)).ok_or("control load timed out")?;
        Ok(json!({"bad_words": bad_words, "words": len / 8, "load_bad": c.statuses.iter().filter(|s| !s.is_ok()).count(),
            "control_bad_words": control_bad_words, "control_load_bad": c2.statuses.iter().filter(|s| !s.is_ok()).count()}))
    }
}

pub(crate) fn pattern_bytes(seed: u64, first_word: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    for j in 0..(len / 8) as u64 {
        v.extend_from_slice(&word(seed, first_word + j).to_le_bytes());
    }
    v
}

fn fill_pattern(gpu: Option<&cu::Gpu>, mem: &Mem, seed: u64) -> Result<(), String> {
    const STEP: usize = 64 << 20;
    let len = mem.len();
    let mut off = 0;
    while off < len {
        let n = STEP.min(len - off);
        let bytes = pattern_bytes(seed, (off / 8) as u64, n);
        match mem {
            Mem::Host(m) => {
                // SAFETY: inside our own mapping of `len` bytes; nobody else writes it now
                // (the pool copies only while a transfer runs).
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), m.as_ptr().add(off), n) };
            }
            Mem::Cuda { ptr, .. } => gpu.ok_or("cuda memory without gpu")?.htod(ptr + off as u64, &bytes)?,
        }
        off += n;
    }
    Ok(())
}

fn fill_poison(gpu: Option<&cu::Gpu>, mem: &Mem) -> Result<(), String> {
    match mem {
        // SAFETY: our own mapping, written only by us or by the pool during a load.
        Mem::Host(m) => unsafe { std::ptr::write_bytes(m.as_ptr(), POISON, m.len()) },
        Mem::Cuda { ptr, len } => gpu.ok_or("cuda memory without gpu")?.memset(*ptr, POISON, *len)?,
    }
    Ok(())
}

fn read_mem(gpu: Option<&cu::Gpu>, mem: &Mem, off: usize, len: usize) -> Result<Vec<u8>, String> {
    if off + len > mem.len() {
        return Err("read past the allocation".into());
    }
    match mem {
        Mem::Host(m) => {
            let mut v = vec![0u8; len];
            // SAFETY: inside our mapping (checked above).
            unsafe { std::ptr::copy_nonoverlapping(m.as_ptr().add(off), v.as_mut_ptr(), len) };
            Ok(v)
        }
        Mem::Cuda { ptr, .. } => gpu.ok_or("cuda memory without gpu")?.dtoh(ptr + off as u64, len),
    }
}

/// Median ns of copying `bytes` from one heap buffer to another, split into `threads`
/// contiguous chunks copied by as many threads at once (1: one plain memcpy). Buffers are
/// touched before timing; one untimed warm-up copy.
fn host_memcpy_ns(bytes: usize, reps: usize, threads: usize) -> u64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let chunk = bytes.div_ceil(threads).max(1);
    let mut v = Vec::new();
    for _ in 0..reps + 1 {
        let t = Instant::now();
        if threads == 1 {
            dst.copy_from_slice(&src);
        } else {
            std::thread::scope(|s| {
                for (d, sr) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
                    s.spawn(move || d.copy_from_slice(sr));
                }
            });
        }
        std::hint::black_box(&mut dst);
        v.push(t.elapsed().as_nanos() as f64);
    }
    v.remove(0);
    median(v) as u64
}
