//! A worker process for the multi-process tests: registers a KV layout over its own
//! memory (the pool reaches it with process_vm_readv/writev), stores or loads blocks whose
//! bytes follow `fill_pattern(key)`, verifies every loaded byte, and prints one JSON line.

use std::time::{Duration, Instant};

use clap::{Parser, Subcommand, ValueEnum};
use umbp_integration_tests::fill_pattern;
use umbp_worker::{BlockStatus, MemorySpec, ObjectKey, Segment, Worker, WorkerConfig, WorkerError};

#[derive(Clone, Copy, ValueEnum, Debug)]
enum Layout {
    /// One segment per layer, pages back to back (vLLM per-layer tensors).
    PerLayer,
    /// One segment per layer with a gap after every page (another stride, same objects).
    Strided,
    /// One segment: a block is all layers contiguous (cross-layer layout).
    Cross,
}

#[derive(Clone, Copy, ValueEnum, Debug, PartialEq)]
enum KeyMode {
    Derived,
    Colliding,
}

static KEY_MODE: std::sync::OnceLock<KeyMode> = std::sync::OnceLock::new();

#[derive(Parser)]
struct Args {
    #[arg(long)]
    socket: std::path::PathBuf,
    #[arg(long, default_value_t = 1)]
    namespace: u128,
    #[arg(long, value_enum, default_value = "per-layer")]
    layout: Layout,
    #[arg(long, default_value_t = 4)]
    layers: u64,
    #[arg(long, default_value_t = 4096)]
    page: u64,
    #[arg(long, default_value_t = 64)]
    blocks: u64,
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
    /// How block numbers become keys: `derived` as the vLLM connector derives them,
    /// `colliding` chosen so that all share one home slot under the index's old unkeyed
    /// mix (an attacker's keys: docs/security.md).
    #[arg(long, value_enum, default_value = "derived")]
    keys: KeyMode,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Store keys first_key..first_key+count.
    Store {
        #[arg(long)]
        first_key: u128,
        #[arg(long)]
        count: u64,
    },
    /// Load keys first_key..first_key+count and verify every byte.
    Load {
        #[arg(long)]
        first_key: u128,
        #[arg(long)]
        count: u64,
    },
    /// Store fresh keys in a loop until killed (for kill-mid-transfer tests).
    StoreLoop {
        #[arg(long)]
        first_key: u128,
    },
    /// Store `blocks` keys, print "flooding", then keep `depth` loads of all of them in
    /// flight for `seconds` (a peer that floods the pool); counts Busy completions.
    FloodLoads {
        #[arg(long)]
        first_key: u128,
        #[arg(long)]
        seconds: u64,
        #[arg(long, default_value_t = 64)]
        depth: usize,
    },
    /// Store one fresh block at a time for `seconds`, waiting for each; prints latency
    /// percentiles (a well-behaved peer).
    Latency {
        #[arg(long)]
        first_key: u128,
        #[arg(long)]
        seconds: u64,
    },
    /// Store keys first_key..first_key+count, touching (scheduler hints, through an index
    /// client of the same namespace) every key stored so far after each batch; print
    /// "pinned", then keep re-touching all of them for `seconds` (a peer pinning the pool).
    StorePin {
        #[arg(long)]
        first_key: u128,
        #[arg(long)]
        count: u64,
        #[arg(long)]
        seconds: u64,
    },
    /// Print the pool's state report as this process's uid gets it (no worker attach).
    Stats,
}

struct Kv {
    mem: Vec<u8>,
    segments: Vec<Segment>,
    object_bytes: usize,
}

impl Kv {
    fn new(a: &Args) -> Self {
        let (l, p, b) = (a.layers, a.page, a.blocks);
        let (bytes, segments) = match a.layout {
            Layout::PerLayer => (l * b * p, (0..l).map(|i| Segment::new(0, i * b * p, p, p, b)).collect()),
            Layout::Strided => (l * b * 2 * p, (0..l).map(|i| Segment::new(0, i * b * 2 * p, 2 * p, p, b)).collect()),
            Layout::Cross => (l * b * p, vec![Segment::new(0, 0, l * p, l * p, b)]),
        };
        Self { mem: vec![0u8; bytes as usize], segments, object_bytes: (l * p) as usize }
    }

    fn pages(&self, block: u64) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.segments.iter().map(move |s| ((s.offset + block * s.block_stride) as usize, s.page_bytes as usize))
    }

    fn fill(&mut self, block: u64, key: u128) {
        let mut obj = vec![0u8; self.object_bytes];
        fill_pattern(key, &mut obj);
        let pages: Vec<_> = self.pages(block).collect();
        let mut at = 0;
        for (off, len) in pages {
            self.mem[off..off + len].copy_from_slice(&obj[at..at + len]);
            at += len;
        }
    }

    fn verify(&self, block: u64, key: u128) -> bool {
        let mut obj = vec![0u8; self.object_bytes];
        fill_pattern(key, &mut obj);
        let mut at = 0;
        for (off, len) in self.pages(block) {
            if self.mem[off..off + len] != obj[at..at + len] {
                return false;
            }
            at += len;
        }
        true
    }

    fn scrub(&mut self, block: u64) {
        let pages: Vec<_> = self.pages(block).collect();
        for (off, len) in pages {
            self.mem[off..off + len].fill(0xEE);
        }
    }
}

#[derive(Default)]
struct Tally {
    stored: u64,
    already_present: u64,
    not_stored: u64,
    loaded: u64,
    missing: u64,
    failed: u64,
    invalid: u64,
    corrupt: u64,
    errors: Vec<String>,
    max_wait_ms: u64,
}

fn main() {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).with_writer(std::io::stderr).init();
    let args = Args::parse();
    KEY_MODE.set(args.keys).expect("set once");
    if let Cmd::Stats = args.cmd {
        println!("{}", umbp_integration_tests::report_json(&args.socket));
        return;
    }
    let mut kv = Kv::new(&args);
    let mut cfg = WorkerConfig::new(&args.socket, args.namespace);
    cfg.timeout = Duration::from_millis(args.timeout_ms);
    let mut w = match Worker::connect(cfg) {
        Ok(w) => w,
        Err(e) => {
            println!("{}", serde_json::json!({ "error": e.to_string() }));
            std::process::exit(3);
        }
    };
    // SAFETY: `kv` is declared before `w` (outlives it); its bytes are filled before a store
    // is submitted and checked after a load completed, never while one is in flight.
    let alloc = unsafe { w.register_memory(MemorySpec::HostProcess { ptr: kv.mem.as_ptr() as usize, len: kv.mem.len() }) }
        .expect("register memory");
    assert_eq!(alloc, 0);
    let obj = match w.register_layout(0, kv.segments.clone()) {
        Ok(o) => o,
        Err(e) => {
            println!("{}", serde_json::json!({ "error": e.to_string() }));
            std::process::exit(3);
        }
    };
    assert_eq!(obj as usize, kv.object_bytes);
    let mut t = Tally::default();
    match args.cmd {
        Cmd::Store { first_key, count } => run(&mut w, &mut kv, &mut t, first_key, count, true),
        Cmd::Load { first_key, count } => run(&mut w, &mut kv, &mut t, first_key, count, false),
        Cmd::StoreLoop { first_key } => {
            println!("ready");
            let mut k = first_key;
            loop {
                run(&mut w, &mut kv, &mut t, k, args.blocks, true);
                k += args.blocks as u128;
            }
        }
        Cmd::FloodLoads { first_key, seconds, depth } => {
            run(&mut w, &mut kv, &mut t, first_key, args.blocks, true);
            println!("flooding");
            return flood(&mut w, &args, first_key, seconds, depth);
        }
        Cmd::Latency { first_key, seconds } => return latency(&mut w, &mut kv, first_key, seconds),
        Cmd::StorePin { first_key, count, seconds } => store_pin(&mut w, &mut kv, &mut t, &args, first_key, count, seconds),
        Cmd::Stats => unreachable!("handled before attaching"),
    }
    println!(
        "{}",
        serde_json::json!({
            "stored": t.stored, "already_present": t.already_present, "not_stored": t.not_stored,
            "loaded": t.loaded, "missing": t.missing, "failed": t.failed, "invalid": t.invalid,
            "corrupt": t.corrupt, "errors": t.errors, "max_wait_ms": t.max_wait_ms,
        })
    );
}

/// Key of the `i`-th block hash in namespace `ns`, derived as the vLLM connector does
/// (or chosen to collide: `--keys colliding`).
fn key_of(ns: u128, i: u128) -> ObjectKey {
    match KEY_MODE.get().copied().unwrap_or(KeyMode::Derived) {
        KeyMode::Derived => ObjectKey::derive(ns, 0, 0, &i.to_le_bytes()),
        KeyMode::Colliding => {
            // lo ^ rotl(hi, 32) is the same for every i: protocol v2 homed them all alike.
            let hi = i as u64;
            let lo = hi.rotate_left(32) ^ 0x5eed_5eed_5eed_5eed;
            ObjectKey(((hi as u128) << 64) | lo as u128)
        }
    }
}

/// Hints for `keys`, in chunks the hint ring takes (the pool drains it every few ms).
fn touch_all(idx: &mut umbp_scheduler::IndexClient, keys: &[ObjectKey]) {
    for chunk in keys.chunks(512) {
        idx.touch(chunk);
        std::thread::sleep(Duration::from_millis(6));
    }
}

#[allow(clippy::too_many_arguments)]
fn store_pin(w: &mut Worker, kv: &mut Kv, t: &mut Tally, args: &Args, first: u128, count: u64, seconds: u64) {
    use std::io::Write;
    let ns = w.config().namespace;
    let mut idx = umbp_scheduler::IndexClient::connect(&args.socket, ns, Duration::from_secs(5)).expect("index client");
    let mut keys = Vec::new();
    let mut done = 0;
    while done < count {
        let n = args.blocks.min(count - done);
        run(w, kv, t, first + done as u128, n, true);
        keys.extend((0..n).map(|i| key_of(ns, first + (done + i) as u128)));
        done += n;
        touch_all(&mut idx, &keys);
    }
    println!("pinned");
    let _ = std::io::stdout().flush();
    let end = Instant::now() + Duration::from_secs(seconds);
    while Instant::now() < end {
        touch_all(&mut idx, &keys);
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn run(w: &mut Worker, kv: &mut Kv, t: &mut Tally, first: u128, count: u64, store: bool) {
    let ns = w.config().namespace;
    let blocks = kv.segments.iter().map(|s| s.num_blocks).min().unwrap();
    let mut done = 0;
    while done < count {
        let n = blocks.min(count - done);
        let batch: Vec<(ObjectKey, u64)> = (0..n).map(|i| (key_of(ns, first + (done + i) as u128), i)).collect();
        for &(k, b) in &batch {
            if store {
                kv.fill(b, k.0);
            } else {
                kv.scrub(b);
            }
        }
        let started = Instant::now();
        let id = loop {
            let r = if store { w.store(0, &batch) } else { w.load(0, &batch) };
            match r {
                Ok(id) => break Some(id),
                Err(WorkerError::Full) => std::thread::sleep(Duration::from_millis(1)),
                Err(e) => {
                    t.errors.push(e.to_string());
                    break None;
                }
            }
        };
        let Some(id) = id else {
            t.failed += n;
            done += n;
            continue;
        };
        let c = loop {
            if let Some(c) = w.wait(id, Duration::from_millis(100)) {
                break c;
            }
            assert!(started.elapsed() < Duration::from_secs(60), "transfer never completed");
        };
        t.max_wait_ms = t.max_wait_ms.max(started.elapsed().as_millis() as u64);
        for (s, &(k, b)) in c.statuses.iter().zip(&batch) {
            match s {
                BlockStatus::Stored => t.stored += 1,
                BlockStatus::AlreadyPresent => t.already_present += 1,
                BlockStatus::NotStored => t.not_stored += 1,
                BlockStatus::Loaded => {
                    t.loaded += 1;
                    if !kv.verify(b, k.0) {
                        t.corrupt += 1;
                    }
                }
                BlockStatus::Missing => t.missing += 1,
                BlockStatus::Invalid => t.invalid += 1,
                _ => t.failed += 1,
            }
        }
        done += n;
    }
}

fn flood(w: &mut Worker, args: &Args, first: u128, seconds: u64, depth: usize) {
    use std::io::Write;
    let ns = w.config().namespace;
    let batch: Vec<(ObjectKey, u64)> = (0..args.blocks).map(|i| (key_of(ns, first + i as u128), i)).collect();
    let (mut submitted, mut busy, mut ok, mut other) = (0u64, 0u64, 0u64, 0u64);
    let mut inflight = 0usize;
    let end = Instant::now() + Duration::from_secs(seconds);
    while Instant::now() < end {
        while inflight < depth {
            match w.load(0, &batch) {
                Ok(_) => {
                    submitted += 1;
                    inflight += 1;
                }
                Err(_) => break,
            }
        }
        for c in w.poll() {
            inflight -= 1;
            match c.error {
                Some(umbp_worker::CqeError::Busy) => busy += 1,
                None if c.all_ok() => ok += 1,
                _ => other += 1,
            }
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    println!("{}", serde_json::json!({ "submitted": submitted, "busy": busy, "ok": ok, "other": other }));
    let _ = std::io::stdout().flush();
}

fn latency(w: &mut Worker, kv: &mut Kv, first: u128, seconds: u64) {
    let ns = w.config().namespace;
    let mut lat_us = Vec::new();
    let mut failed = 0u64;
    let end = Instant::now() + Duration::from_secs(seconds);
    let mut k = first;
    while Instant::now() < end {
        let key = key_of(ns, k);
        k += 1;
        kv.fill(0, key.0);
        let started = Instant::now();
        let id = match w.store(0, &[(key, 0)]) {
            Ok(id) => id,
            Err(_) => {
                failed += 1;
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
        };
        match w.wait(id, Duration::from_secs(10)) {
            Some(c) if c.all_ok() => lat_us.push(started.elapsed().as_micros() as u64),
            _ => failed += 1,
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    lat_us.sort_unstable();
    let pct = |p: f64| lat_us.get(((lat_us.len() as f64 * p).ceil() as usize).saturating_sub(1)).copied().unwrap_or(0);
    println!(
        "{}",
        serde_json::json!({
            "samples": lat_us.len(), "failed": failed,
            "p50_us": pct(0.50), "p99_us": pct(0.99), "max_us": lat_us.last().copied().unwrap_or(0),
        })
    );
}
