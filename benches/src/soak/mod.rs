//! `umbp-bench soak`: a chaos soak of a real `umbp-pool` process and real worker processes
//! (docs/reliability.md).
//!
//! `--workers` processes (this binary re-executed as `__soak-worker`) store and load
//! checksummed blocks at random, over one shared key space, for `--seconds`, while a chaos
//! loop SIGKILLs workers (and starts replacements), SIGSTOPs and SIGCONTs the pool, and
//! kills and restarts the pool at the same socket. It checks, and fails (exit 1) when one
//! does not hold:
//!
//! - `corrupted_bytes` = 0: every block a load reports `Loaded` has exactly the bytes its
//!   key's pattern says, whoever stored it;
//! - `max_blocked_ms` <= `--timeout-ms`: no worker call (submit, poll) took longer than the
//!   engine timeout, and no `wait(t)` returned later than `t` plus the timeout;
//! - `leaked_bytes` = 0 and no leaked fd: after every worker death (the others paused with
//!   nothing in flight) every allocated byte of the pool belongs to a published object, no
//!   object is pinned, and the pool has exactly its baseline fds plus those of the live
//!   attachments;
//! - every worker is attached again at the end.
//!
//! A fault-free warm-up phase first measures the operation rate the `operations` case is
//! compared with (docs/benchmarks.md: the baseline is measured in the same run).

//!
//! Files: this one (command line, shared constants, the chaos loop and its checks),
//! `worker.rs` (the worker process), `procs.rs` (worker processes seen from the parent),
//! `pool.rs` (the pool process, and the `__soak-pool` test pool), `cluster.rs` (`--cluster`:
//! a second member holding objects the soak's workers load over NIXL).

mod cluster;
mod pool;
mod procs;
mod worker;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use umbp_integration_tests::eventually;
use umbp_pool::PoolReport;
use umbp_worker::ObjectKey;

use self::pool::{describe, kind_diff, log_tail, settled_fds, worker_attachments, PoolCmd, PoolProc, SIGCONT, SIGSTOP};
use self::procs::{Totals, WorkerProc};
use self::worker::SoakCommand;
use super::report::{Better, Case};

pub use self::pool::SoakPoolCli;
pub use self::worker::SoakWorkerCli;

#[derive(clap::Args, Debug, Clone)]
pub struct SoakCli {
    /// Length of the chaos phase.
    #[arg(long, default_value_t = 60)]
    pub seconds: u64,
    /// Worker processes.
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Engine timeout of each worker (`timeout_ms`); also the bound on any blocked call.
    #[arg(long = "timeout-ms", default_value_t = 1000)]
    pub timeout_ms: u64,
    /// Pool DRAM.
    #[arg(long, default_value = "256MiB")]
    pub capacity: String,
    /// Seed of the chaos schedule and the workers' choices.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// The `umbp-pool` binary [default: next to this one].
    #[arg(long = "pool-bin")]
    pub pool_bin: Option<PathBuf>,
    /// Worker KV memory: `process` (any memory, the pool uses process_vm_readv/writev) or
    /// `memfd` (a sealed memfd the pool maps; needed under valgrind, which lacks pidfd_open).
    #[arg(long, default_value = "process", value_parser = ["process", "memfd"])]
    pub memory: String,
    /// Extra flags for every `umbp-pool` start (space separated).
    #[arg(long = "pool-args", default_value = "", allow_hyphen_values = true)]
    pub pool_args: String,
    /// Negative control, TEST ONLY: the pool flips one byte of its DRAM copy of one object
    /// in every N stored, so the run must fail with `corrupted_bytes` > 0. The pool is then
    /// this binary (hidden `__soak-pool`), which arms the fault inside its own process;
    /// `umbp-pool` has no flag, variable or message that arms it.
    #[arg(long = "inject-corruption", value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub inject_corruption: Option<u64>,
    /// A second pool (the holder) in a cluster with the soak's pool, with a worker of its
    /// own on the same keys: loads also promote from the remote tier over NIXL, while the
    /// holder is stopped (remote reads time out, their DRAM is quarantined) and restarted.
    /// Needs the NIXL library (scripts/setup-nixl.sh prints UMBP_NIXL_LIB=...).
    #[arg(long)]
    pub cluster: bool,
    /// One JSON object per case and line.
    #[arg(long)]
    pub json: bool,
}

const NS: u128 = 0x736f_616b;
/// Layout of every worker: LAYERS segments of BLOCKS pages.
const LAYERS: u64 = 4;
const BLOCKS: u64 = 32;
const PAGE: u64 = 16 << 10;
const OBJECT_BYTES: u64 = LAYERS * PAGE;
/// Shared key space (a quarter of it fits a 256 MiB pool at once: eviction runs too).
const KEYS: u64 = 16384;
/// Transfers each worker keeps in flight.
const DEPTH: usize = 4;

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The bytes of the object with `key`: every byte depends on the key and its position.
fn pattern(key: u128, out: &mut [u8]) {
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let w = splitmix(key as u64 ^ (key >> 64) as u64 ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        chunk.copy_from_slice(&w.to_le_bytes()[..chunk.len()]);
    }
}

fn key_of(k: u64) -> ObjectKey {
    ObjectKey::derive(NS, 0, 0, &k.to_le_bytes())
}

struct Soak {
    cli: SoakCli,
    pool: PoolProc,
    workers: Vec<WorkerProc>,
    next_id: u64,
    banked: Totals,
    base_fds: usize,
    fds_per_worker: usize,
    base_kinds: std::collections::BTreeMap<String, i64>,
    worker_kinds: std::collections::BTreeMap<String, i64>,
    leaked_bytes: u64,
    leaked_fds: i64,
    leak_checks: u64,
    /// Pool processes that ended other than by the soak's own SIGKILL (an injected
    /// restart) or, at the end, by its SIGTERM with exit status 0.
    pool_crashes: u64,
    failures: Vec<String>,
    /// `--cluster`: the second member and its worker.
    holder: Option<cluster::Holder>,
    fetches: cluster::FetchTally,
    /// The most DRAM the soak's pool held quarantined at a leak check, and reclaimed.
    quarantine_peak: u64,
    quarantine_reclaimed: u64,
}

impl Soak {
    /// Records a pool process that ended on its own.
    fn pool_crashed(&mut self, when: &str, st: &std::process::ExitStatus) {
        self.pool_crashes += 1;
        let msg =
            format!("{when}: umbp-pool crashed or exited on its own ({}); its log ends: {}", describe(st), log_tail(&self.pool.log, 5));
        eprintln!("soak: {msg}");
        self.failures.push(msg);
    }

    /// Fails the run if the pool ended on its own since the last look, and starts a new
    /// one so that the rest of the run still measures. Called before every injected fault,
    /// around every leak check and at the end, so a crash is never taken for a fault.
    fn check_pool(&mut self, when: &str) -> Result<(), String> {
        if let Some(st) = self.pool.exited() {
            self.pool_crashed(when, &st);
            self.pool.respawn()?;
        }
        if let Some(st) = self.holder.as_mut().and_then(|h| h.pool.exited()) {
            self.holder_crashed(&format!("{when} (the cluster holder)"), &st);
            self.holder.as_mut().expect("checked").pool.respawn()?;
        }
        Ok(())
    }

    fn holder_crashed(&mut self, when: &str, st: &std::process::ExitStatus) {
        self.pool_crashes += 1;
        let log = self.holder.as_ref().map(|h| h.pool.log.clone()).unwrap_or_default();
        let msg = format!("{when}: umbp-pool crashed or exited on its own ({}); its log ends: {}", describe(st), log_tail(&log, 5));
        eprintln!("soak: {msg}");
        self.failures.push(msg);
    }

    /// Every worker: the soak pool's and the holder's.
    fn all_workers(&self) -> impl Iterator<Item = &WorkerProc> {
        self.workers.iter().chain(self.holder.iter().flat_map(|h| h.workers.iter()))
    }

    fn all_workers_mut(&mut self) -> impl Iterator<Item = &mut WorkerProc> {
        self.workers.iter_mut().chain(self.holder.iter_mut().flat_map(|h| h.workers.iter_mut()))
    }

    fn spawn_worker(&mut self) -> Result<(), String> {
        let id = self.next_id;
        self.next_id += 1;
        let w = WorkerProc::spawn(&self.pool.socket, id, self.cli.seed, self.cli.timeout_ms, &self.cli.memory)?;
        self.workers.push(w);
        Ok(())
    }

    fn totals(&self) -> Totals {
        let mut t = self.banked;
        for w in self.all_workers() {
            t.add(&w.last());
        }
        t
    }

    /// Pauses every worker (each finishes what it has in flight) and waits until all say so.
    fn pause_all(&mut self) -> Result<(), String> {
        let before: Vec<u64> = self.all_workers().map(|w| w.state.lock().unwrap().paused).collect();
        for w in self.all_workers_mut() {
            w.send(SoakCommand::Pause);
        }
        let ok = eventually(Duration::from_secs(30), || self.all_workers().zip(&before).all(|(w, b)| w.state.lock().unwrap().paused > *b));
        if ok {
            Ok(())
        } else {
            Err("a worker did not drain its transfers within 30 s of pause".into())
        }
    }

    fn resume_all(&mut self) {
        for w in self.all_workers_mut() {
            w.send(SoakCommand::Resume);
        }
    }

    /// With every worker paused: the pool holds only published, unpinned objects, all its
    /// allocated bytes belong to them, and it has its baseline fds plus the live workers'.
    fn leak_check(&mut self, when: &str) -> Result<(), String> {
        self.check_pool(when)?;
        self.pause_all()?;
        let live = self.workers.len();
        let mut last: Option<PoolReport> = None;
        let settled = eventually(Duration::from_secs(20), || {
            let Ok(r) = self.pool.report() else { return false };
            let ok = worker_attachments(&r) == live && r.pool.objects == r.pool.published_objects && r.pool.pinned_objects == 0;
            last = Some(r);
            ok
        });
        let pool_json = last.as_ref().map_or_else(|| "null".to_string(), |r| r.pool.to_string());
        if !settled {
            let attached = last.as_ref().map_or(0, worker_attachments);
            self.failures.push(format!("{when}: pool did not settle: {attached} worker attachments of {live}, pool {pool_json}"));
            // A pool that died meanwhile explains it (and must be counted as a crash).
            self.check_pool(when)?;
        }
        if let Some(r) = &last {
            self.fetches.observe(self.pool.starts, r);
            self.quarantine_peak = self.quarantine_peak.max(r.pool.quarantined_bytes);
            self.quarantine_reclaimed = self.quarantine_reclaimed.max(r.pool.quarantine_reclaimed_bytes);
        }
        let allocated = last.as_ref().map_or(0, |r| r.pool.allocated_bytes);
        // DRAM a timed-out remote read may still write stays allocated, held by no object
        // (the quarantine: bounded, counted apart, reclaimed when its holder is forgotten).
        let quarantined = last.as_ref().map_or(0, |r| r.pool.quarantined_bytes);
        let published = last.as_ref().map_or(0, |r| r.pool.published_objects);
        // With an SSD tier (--pool-args --ssd-dir), published objects on SSD hold no DRAM.
        let in_dram = last.as_ref().map_or(0, |r| if r.ssd.is_some() { r.tiers.dram } else { published });
        let leaked = allocated.saturating_sub(in_dram * OBJECT_BYTES + quarantined);
        self.leaked_bytes = self.leaked_bytes.max(leaked);
        if leaked > 0 {
            self.failures.push(format!("{when}: {leaked} bytes allocated beyond published objects: {pool_json}"));
        }
        let want = self.base_fds + live * self.fds_per_worker;
        let mut fds = 0;
        eventually(Duration::from_secs(10), || {
            fds = self.pool.fds();
            fds == want
        });
        if fds != want {
            self.leaked_fds = self.leaked_fds.max(fds as i64 - want as i64);
            let mut expect = self.base_kinds.clone();
            for (k, v) in &self.worker_kinds {
                *expect.entry(k.clone()).or_insert(0) += v * live as i64;
            }
            self.failures.push(format!(
                "{when}: pool has {fds} fds, expected {want} ({} + {live} x {}); by kind vs expected: {}",
                self.base_fds,
                self.fds_per_worker,
                kind_diff(&self.pool.fd_kinds(), &expect).join(", ")
            ));
        }
        // `--cluster`: TCP sockets (control connections, UCX endpoints) follow the one peer,
        // whatever happened to it: bounded, not growing with its restarts.
        if self.holder.is_some() {
            let tcp = self.pool.tcp_fds();
            if tcp > cluster::MAX_TCP_FDS {
                self.failures.push(format!("{when}: pool has {tcp} TCP sockets with one cluster peer (bound {})", cluster::MAX_TCP_FDS));
            }
        }
        // The SSD tier holds one fd per segment file, no more.
        if let Some(segments) = last.as_ref().and_then(|r| r.ssd.as_ref()).map(|s| s.segments) {
            let open = self.pool.segment_fds() as u64;
            if open != segments {
                self.failures.push(format!("{when}: pool has {open} SSD segment fds for {segments} segments"));
            }
        }
        self.leak_checks += 1;
        self.resume_all();
        Ok(())
    }
}

impl SoakCli {
    pub fn run(self) -> Result<(), String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let (bin, pre_args) = match (self.inject_corruption, &self.pool_bin) {
            (Some(_), Some(_)) => {
                return Err("--inject-corruption runs its own test pool (this binary): it cannot be combined with --pool-bin".into())
            }
            (Some(_), None) if !self.pool_args.trim().is_empty() => {
                return Err("--inject-corruption runs its own test pool, which takes no --pool-args".into())
            }
            (Some(n), None) => (exe.clone(), vec!["__soak-pool".to_string(), "--inject-corruption".into(), n.to_string()]),
            (None, Some(b)) => (b.clone(), Vec::new()),
            (None, None) => (exe.with_file_name("umbp-pool"), Vec::new()),
        };
        if !bin.exists() {
            return Err(format!("{} not found: build it (cargo build --bins) or pass --pool-bin", bin.display()));
        }
        let mut dir = tempfile::Builder::new()
            .prefix("umbp-soak-")
            .tempdir()
            .map_err(|e| format!("creating a directory in {}: {e}", std::env::temp_dir().display()))?;
        // Kept for reading (the pool log) when the run fails; removed at the end otherwise.
        dir.disable_cleanup(true);
        let socket = dir.path().join("pool.sock");
        let log = dir.path().join("pool.log");
        let mut args: Vec<String> = vec!["--capacity".into(), self.capacity.clone(), "--min-object-size".into(), "64KiB".into()];
        args.extend(self.pool_args.split_whitespace().map(String::from));
        let holder_cmd = if self.cluster {
            let (member, holder) = cluster::setup(dir.path(), &bin, &self.capacity)?;
            args.extend(member);
            Some(holder)
        } else {
            None
        };
        let mut pool = PoolProc::start(&PoolCmd { bin, pre_args, args }, &socket, &log)?;
        pool.skip_tcp = self.cluster;
        let holder = holder_cmd.map(|cmd| cluster::Holder::start(&cmd, dir.path())).transpose()?;
        let base_fds = settled_fds(&pool, |_| true);
        let base_kinds = pool.fd_kinds();
        let mut s = Soak {
            cli: self.clone(),
            pool,
            workers: Vec::new(),
            next_id: 0,
            banked: Totals::default(),
            base_fds,
            fds_per_worker: 0,
            base_kinds,
            worker_kinds: Default::default(),
            leaked_bytes: 0,
            leaked_fds: 0,
            leak_checks: 0,
            pool_crashes: 0,
            failures: Vec::new(),
            holder,
            fetches: Default::default(),
            quarantine_peak: 0,
            quarantine_reclaimed: 0,
        };
        for _ in 0..self.workers.max(1) {
            s.spawn_worker()?;
        }
        if let Some(h) = s.holder.as_mut() {
            // One worker on the holder: it stores (and loads) the same keys, so the soak's
            // pool lists objects only the holder has.
            let w = WorkerProc::spawn(&h.pool.socket, s.next_id, self.seed, self.timeout_ms, &self.memory)?;
            s.next_id += 1;
            h.workers.push(w);
        }
        let n = s.workers.len();
        // Per-attachment fds, measured with everyone attached and idle.
        s.pause_all()?;
        let attached = eventually(Duration::from_secs(20), || s.pool.report().is_ok_and(|r| worker_attachments(&r) == n));
        if !attached {
            return Err("workers did not attach".into());
        }
        let with = settled_fds(&s.pool, |f| f > base_fds && (f - base_fds) % n == 0);
        if with < base_fds || (with - base_fds) % n != 0 {
            return Err(format!("cannot measure fds per attachment: {base_fds} idle, {with} with {n} workers"));
        }
        s.fds_per_worker = (with - base_fds) / n;
        let with_kinds = s.pool.fd_kinds();
        for (k, v) in &with_kinds {
            let d = v - s.base_kinds.get(k).unwrap_or(&0);
            if d != 0 {
                s.worker_kinds.insert(k.clone(), d / n as i64);
            }
        }
        s.resume_all();

        // Fault-free warm-up: the baseline rate.
        let warmup = Duration::from_secs((self.seconds / 6).clamp(2, 5));
        let t0 = s.totals();
        std::thread::sleep(warmup);
        let t1 = s.totals();
        let base_rate = (t1.transfers - t0.transfers) / warmup.as_secs_f64();
        eprintln!("soak: warm-up done ({base_rate:.0} transfers/s without faults); chaos phase for {} s", self.seconds);

        let bar = if self.json { indicatif::ProgressBar::hidden() } else { indicatif::ProgressBar::new(self.seconds) };
        bar.set_style(
            indicatif::ProgressStyle::with_template("soak [{bar:30}] {pos}/{len} s {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        let mut rng = splitmix(self.seed ^ 0x50a4);
        let mut rand = move |n: u64| {
            rng = splitmix(rng);
            rng % n.max(1)
        };
        let (mut kills, mut stops, mut restarts) = (0u64, 0u64, 0u64);
        let mut tick = 0u64;
        let start = Instant::now();
        let deadline = start + Duration::from_secs(self.seconds);
        while Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(200 + rand(1000)));
            // A pool that died on its own since the last fault is a crash, not a fault.
            s.check_pool(&format!("chaos phase, {:.1} s in", start.elapsed().as_secs_f64()))?;
            if Instant::now() >= deadline {
                break;
            }
            // `--cluster` adds two faults of the holder (9, 10) to the schedule of the others,
            // and makes them the first two, so even a short run stops and restarts the holder.
            let fault = match (s.holder.is_some(), tick) {
                (true, 0) => 9,
                (true, 1) => 10,
                (true, _) => rand(11),
                (false, _) => rand(9),
            };
            tick += 1;
            match fault {
                0..=3 => {
                    let i = rand(s.workers.len() as u64) as usize;
                    let mut w = s.workers.swap_remove(i);
                    let last = w.kill();
                    s.banked.add(&last);
                    kills += 1;
                    s.leak_check(&format!("after worker kill {kills}"))?;
                    s.spawn_worker()?;
                }
                4..=6 => {
                    s.pool.signal(SIGSTOP);
                    std::thread::sleep(Duration::from_millis(100 + rand(2 * self.timeout_ms)));
                    s.pool.signal(SIGCONT);
                    stops += 1;
                }
                9 => {
                    let ms = 100 + rand(2 * self.timeout_ms);
                    s.holder.as_mut().expect("drawn only with a holder").stop_for(ms);
                }
                10 => {
                    let h = s.holder.as_mut().expect("drawn only with a holder");
                    match h.pool.restart()? {
                        Some(st) => s.holder_crashed(
                            &format!("chaos phase, {:.1} s in (before a holder restart)", start.elapsed().as_secs_f64()),
                            &st,
                        ),
                        None => h.restarts += 1,
                    }
                }
                _ => {
                    std::thread::sleep(Duration::from_millis(rand(300)));
                    match s.pool.restart()? {
                        // It had ended on its own before our SIGKILL: a crash, not a fault.
                        Some(st) => {
                            s.pool_crashed(&format!("chaos phase, {:.1} s in (before a restart)", start.elapsed().as_secs_f64()), &st)
                        }
                        None => restarts += 1,
                    }
                }
            }
            bar.set_position(start.elapsed().as_secs().min(self.seconds));
            bar.set_message(format!("{kills} worker kills, {stops} pool stops, {restarts} pool restarts"));
        }
        bar.finish_and_clear();
        s.check_pool("after the chaos phase")?;

        // All workers must come back (the last fault may have been a pool restart).
        let reattached = eventually(Duration::from_secs(30), || {
            s.pool.report().is_ok_and(|r| worker_attachments(&r) == n) && s.all_workers().all(|w| w.last()["connected"] == true)
        });
        if !reattached {
            s.failures.push("not every worker re-attached within 30 s of the last fault".into());
        }
        s.leak_check("at the end")?;
        // SSD tier (`--pool-args --ssd-dir ...`): promotions of the last pool process (a
        // restart on the same directory serves the objects again).
        let (ssd_promotions, ssd_promotion_failures) =
            s.pool.report().ok().and_then(|r| r.ssd).map_or((0, 0), |ssd| (ssd.promotions, ssd.promotion_failures));
        s.pause_all()?;
        let mut total = s.banked;
        for w in s.all_workers_mut() {
            w.send(SoakCommand::Quit);
        }
        for w in s.all_workers_mut() {
            total.add(&w.reap());
        }
        let (fetches, fetch_failures) = s.fetches.totals();
        let (holder_stops, holder_restarts) = s.holder.as_ref().map_or((0, 0), |h| (h.stops, h.restarts));
        if let Some(mut h) = s.holder.take() {
            match h.pool.stop(Duration::from_secs(120)) {
                Ok(st) if st.success() => {}
                Ok(st) => {
                    s.holder = Some(h);
                    s.holder_crashed("at the clean stop of the cluster holder (SIGTERM)", &st);
                }
                Err(e) => {
                    s.pool_crashes += 1;
                    s.failures.push(format!("the cluster holder: {e}"));
                }
            }
        }
        // The clean stop: exit status 0, or the run fails (a sanitizer's or valgrind's
        // error exit code comes back here, as does a crash during shutdown).
        let final_exit = match s.pool.stop(Duration::from_secs(120)) {
            Ok(st) if st.success() => describe(&st),
            Ok(st) => {
                s.pool_crashed("at the clean stop (SIGTERM)", &st);
                describe(&st)
            }
            Err(e) => {
                s.pool_crashes += 1;
                s.failures.push(e.clone());
                e
            }
        };
        let injected_flips = std::fs::read_to_string(&log).map_or(0, |t| t.matches("TEST FAULT: flipped a byte").count() as u64);

        let chaos_s = start.elapsed().as_secs_f64();
        let ops = total.transfers - t1.transfers;
        let faults = kills + stops + restarts + holder_stops + holder_restarts;
        if total.corrupt_bytes > 0.0 {
            s.failures.push(format!("{} corrupted bytes were returned as Loaded", total.corrupt_bytes));
        }
        if total.max_blocked_ms > self.timeout_ms as f64 {
            s.failures
                .push(format!("a worker call blocked {} ms past what it allowed (bound {} ms)", total.max_blocked_ms, self.timeout_ms));
        }
        let pass = s.failures.is_empty();
        // Kept for reading when the run failed, unless it was meant to (negative control).
        if pass || self.inject_corruption.is_some() {
            dir.disable_cleanup(false);
        }
        let ctx = |c: Case| c.extra("seconds", self.seconds).extra("workers", n as u64).extra("pass", pass);
        let cases = vec![
            ctx(Case::new(
                "soak",
                "operations",
                ops,
                "transfers",
                base_rate * chaos_s,
                "fault-free rate x duration (warm-up phase)",
                Better::Higher,
            ))
            .extra("blocks", (total.blocks) as u64)
            .extra("ops_per_s", (ops / chaos_s).round()),
            ctx(Case::new("soak", "faults_injected", faults as f64, "faults", 0.0, "faults in the warm-up phase", Better::Higher))
                .extra("worker_kills", kills)
                .extra("pool_stops", stops)
                .extra("pool_restarts", restarts)
                .extra("holder_stops", holder_stops)
                .extra("holder_restarts", holder_restarts),
            ctx(Case::new("soak", "corrupted_bytes", total.corrupt_bytes, "bytes", 0.0, "allowed", Better::Lower))
                .extra("verified_blocks", total.loaded as u64)
                .extra("verified_bytes", total.loaded as u64 * OBJECT_BYTES)
                .extra("cancelled_transfers", total.cancelled as u64)
                .extra("worker_disconnects", total.disconnects as u64)
                .extra("started_load_waits", total.started_waits as u64)
                .extra("ssd_promotions", ssd_promotions)
                .extra("ssd_promotion_failures", ssd_promotion_failures)
                .extra("remote_fetches", fetches)
                .extra("remote_fetch_failures", fetch_failures)
                .extra("quarantine_peak_bytes", s.quarantine_peak)
                .extra("quarantine_reclaimed_bytes", s.quarantine_reclaimed)
                .extra("inject_corruption", self.inject_corruption.unwrap_or(0))
                .extra("injected_flips", injected_flips),
            ctx(Case::new("soak", "pool_crashes", s.pool_crashes as f64, "crashes", 0.0, "allowed", Better::Lower))
                .extra("pool_processes", s.pool.starts)
                .extra("final_exit", final_exit),
            ctx(Case::new("soak", "leaked_bytes", s.leaked_bytes as f64, "bytes", 0.0, "allowed", Better::Lower))
                .extra("leak_checks", s.leak_checks)
                .extra("leaked_fds", s.leaked_fds)
                .extra("fds_per_worker", s.fds_per_worker as u64),
            ctx(Case::new(
                "soak",
                "max_blocked_ms",
                total.max_blocked_ms,
                "ms",
                self.timeout_ms as f64,
                "engine timeout_ms (the bound)",
                Better::Lower,
            ))
            .extra("all_reattached", reattached)
            .extra("call", total.max_blocked_call.unwrap_or("")),
        ];
        super::report::print(&cases, self.json);
        if pass {
            Ok(())
        } else {
            Err(format!("soak failed: {} (pool log: {})", s.failures.join("; "), log.display()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::worker::blocked_ms;
    use super::*;

    /// `wait(t)` may take `t` + timeout, not `t` + 2 x timeout: a 20 ms wait that took
    /// 1.5 timeouts more blocked 1.5 timeouts (before: the allowance was `t` + timeout, so it
    /// counted as 0.5 and a run with a 1 s timeout passed a wait that returned 1.52 s late).
    #[test]
    fn wait_bound_is_t_plus_timeout() {
        let (t, timeout) = (Duration::from_millis(20), Duration::from_millis(1000));
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        assert!((blocked_ms(t, t + timeout * 3 / 2) - ms(timeout * 3 / 2)).abs() < 1e-6);
        assert!(blocked_ms(t, t + timeout * 3 / 2) > ms(timeout), "fails the run");
        assert!(blocked_ms(t, t + timeout / 2) < ms(timeout), "within the bound");
        assert_eq!(blocked_ms(t, t / 2), 0.0);
        assert_eq!(blocked_ms(Duration::ZERO, timeout), ms(timeout));
    }
}
