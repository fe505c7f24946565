//! `umbp-bench ring`: cross-process round trip over an attachment's SQ and CQ rings,
//! against a unix-socket round trip of the same 64 bytes measured in the same run.
//!
//! This process plays the worker: it submits one [`Sqe`] (a Nop) and waits for its
//! [`Cqe`]. A child process (this binary re-executed with the hidden `__ring-peer`
//! subcommand, the attachment memfd and one end of a socketpair inherited) plays the pool:
//! it pops the SQE and pushes one CQE. Three phases, in order, each `warmup + iterations`
//! round trips:
//!
//! 1. socket: write 64 bytes, the peer reads them and writes 64 bytes back (both sides
//!    block in the kernel, like a conventional RPC);
//! 2. poll: both sides spin on their rings (the consumer never sleeps);
//! 3. sleep: both sides sleep on the tail futex as soon as their ring is empty, and each
//!    producer wakes the other side (the `need_wakeup` protocol, docs/protocol.md §1).

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use bytemuck::Zeroable;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Map, Value};
use umbp_ipc::SharedMemory;
use umbp_protocol::attachment::AttachmentLayout;
use umbp_protocol::entries::{Cqe, Opcode, Sqe};
use umbp_protocol::ring::{Consumer, Producer, Ring};

use super::report::{cpus, percentile, Better, Case};
use super::shm::{inherited, raw, spawn_self};

const SQ_ENTRIES: u32 = 64;
const CQ_ENTRIES: u32 = 64;
const HINT_ENTRIES: u32 = 64;
const ARENA_BYTES: u64 = 4096;
/// Bytes each way in the socket baseline: one SQE.
const MSG: usize = core::mem::size_of::<Sqe>();
/// A phase that takes longer than this per round trip has a dead peer.
const STALL: Duration = Duration::from_secs(10);

/// Hidden subcommand name of the peer process.
pub const PEER_SUBCOMMAND: &str = "__ring-peer";

#[derive(Debug, Clone)]
pub struct RingArgs {
    pub iterations: usize,
    pub warmup: usize,
}

fn layout() -> AttachmentLayout {
    AttachmentLayout::new(SQ_ENTRIES, CQ_ENTRIES, HINT_ENTRIES, ARENA_BYTES).expect("valid layout")
}

fn bad(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

/// The two rings of an attachment mapping, as one side sees them.
struct Rings<'a> {
    sq: Ring<'a, Sqe>,
    cq: Ring<'a, Cqe>,
}

fn rings<'a>(map: &'a SharedMemory, l: &AttachmentLayout, init: bool) -> io::Result<Rings<'a>> {
    // SAFETY: both ranges lie inside the mapping (AttachmentLayout keeps them disjoint and
    // within total_bytes), which outlives the returned rings; `init` only runs before the
    // peer process exists.
    unsafe {
        let sq_mem = map.as_ptr().add(l.sq_offset);
        let cq_mem = map.as_ptr().add(l.cq_offset);
        if init {
            Ring::<Sqe>::init(sq_mem, l.sq_bytes(), l.sq_entries).map_err(bad)?;
            Ring::<Cqe>::init(cq_mem, l.cq_bytes(), l.cq_entries).map_err(bad)?;
        }
        Ok(Rings {
            sq: Ring::<Sqe>::attach(sq_mem, l.sq_bytes()).map_err(bad)?,
            cq: Ring::<Cqe>::attach(cq_mem, l.cq_bytes()).map_err(bad)?,
        })
    }
}

fn nop(user_data: u64) -> Sqe {
    Sqe { opcode: Opcode::Nop as u8, user_data, ..Zeroable::zeroed() }
}

/// Spins until the consumer has an entry; errors out after [`STALL`].
fn spin_pop<T: bytemuck::Pod>(c: &mut Consumer<'_, T>) -> io::Result<T> {
    let mut spins = 0u32;
    let mut since: Option<Instant> = None;
    loop {
        if let Some(v) = c.try_pop().map_err(bad)? {
            c.release();
            return Ok(v);
        }
        std::hint::spin_loop();
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(1 << 20) {
            let t = *since.get_or_insert_with(Instant::now);
            if t.elapsed() > STALL {
                return Err(bad("ring peer stalled (poll)"));
            }
        }
    }
}

/// Sleeps on the tail futex until the consumer has an entry.
fn sleep_pop<T: bytemuck::Pod>(c: &mut Consumer<'_, T>) -> io::Result<T> {
    if !c.wait(0, Some(STALL)).map_err(bad)? {
        return Err(bad("ring peer stalled (sleep)"));
    }
    let v = c.try_pop().map_err(bad)?.ok_or_else(|| bad("woken with an empty ring"))?;
    c.release();
    Ok(v)
}

fn push<T: bytemuck::Pod>(p: &mut Producer<'_, T>, v: T) -> io::Result<()> {
    // One request in flight: the ring always has room.
    if !p.try_push(v).map_err(bad)? {
        return Err(bad("ring unexpectedly full"));
    }
    p.publish_and_wake();
    Ok(())
}

struct Progress(ProgressBar);

impl Progress {
    fn new(total: u64) -> Self {
        let bar = ProgressBar::new(total);
        bar.set_style(ProgressStyle::with_template("{msg:>8} [{bar:40}] {pos}/{len} round trips").unwrap());
        Self(bar)
    }

    fn phase(&self, name: &'static str) {
        self.0.set_message(name);
    }

    /// Cheap enough to call per iteration: touches the bar every 4096 steps only.
    fn tick(&self, i: usize) {
        if i % 4096 == 4095 {
            self.0.inc(4096);
        }
    }
}

pub fn run(args: &RingArgs) -> io::Result<Vec<Case>> {
    let l = layout();
    // A sealed memfd, as the pool's attachment regions (docs/security.md "Sealed shared memory").
    let map = SharedMemory::create("umbp-bench-ring", l.total_bytes, false).map_err(io::Error::other)?;
    let Rings { sq, cq } = rings(&map, &l, true)?;
    let mut sq = sq.producer();
    let mut cq = cq.consumer();
    let (mut sock, theirs) = UnixStream::pair()?;
    let total = args.warmup + args.iterations;
    let child = spawn_self(
        &[
            PEER_SUBCOMMAND.to_string(),
            "--fd".into(),
            raw(map.fd()).to_string(),
            "--sock-fd".into(),
            raw(&theirs).to_string(),
            "--rounds".into(),
            total.to_string(),
        ],
        &[raw(map.fd()), raw(&theirs)],
    )?;
    drop(theirs);
    let progress = Progress::new(3 * total as u64);
    let samples = |name: &'static str, round_trip: &mut dyn FnMut(u64) -> io::Result<()>| -> io::Result<Vec<u64>> {
        progress.phase(name);
        let mut out = Vec::with_capacity(args.iterations);
        for i in 0..total {
            let t0 = Instant::now();
            round_trip(i as u64)?;
            let ns = t0.elapsed().as_nanos() as u64;
            if i >= args.warmup {
                out.push(ns);
            }
            progress.tick(i);
        }
        out.sort_unstable();
        Ok(out)
    };

    let mut buf = [0u8; MSG];
    let socket = samples("socket", &mut |i| {
        buf[..8].copy_from_slice(&i.to_le_bytes());
        sock.write_all(&buf)?;
        sock.read_exact(&mut buf)?;
        if buf[..8] != i.to_le_bytes() {
            return Err(bad("socket echo mismatch"));
        }
        Ok(())
    })?;
    let mut round_trip = |i: u64, sleep: bool| -> io::Result<()> {
        push(&mut sq, nop(i))?;
        let c = if sleep { sleep_pop(&mut cq)? } else { spin_pop(&mut cq)? };
        if c.user_data != i {
            return Err(bad(format!("completion {} for submission {i}", c.user_data)));
        }
        Ok(())
    };
    let poll = samples("poll", &mut |i| round_trip(i, false))?;
    let sleep = samples("sleep", &mut |i| round_trip(i, true))?;
    progress.0.finish_and_clear();
    let status = child.wait()?;
    if !status.success() {
        return Err(bad(format!("ring peer failed: {status}")));
    }

    let p = |v: &[u64], q| percentile(v, q);
    let mut extra = Map::new();
    extra.insert("iterations".into(), Value::from(args.iterations));
    extra.insert("warmup".into(), Value::from(args.warmup));
    extra.insert("cpus".into(), Value::from(cpus()));
    extra.insert("msg_bytes".into(), Value::from(MSG));
    extra.insert("socket_rtt_p50_ns".into(), Value::from(p(&socket, 50.0)));
    extra.insert("socket_rtt_p99_ns".into(), Value::from(p(&socket, 99.0)));
    // Each case: percentile `q` of a ring's round trips against the same percentile of the
    // unix-socket round trip.
    let case = |name: &str, rtt: &[u64], q: f64| {
        Case::new("ring", name, p(rtt, q), "ns", p(&socket, q), "unix socket round trip", Better::Lower).extras(&extra)
    };
    Ok(vec![
        case("poll_rtt_p50", &poll, 50.0).extra("min_ns", poll[0]),
        case("poll_rtt_p99", &poll, 99.0).extra("max_ns", *poll.last().unwrap()),
        case("sleep_rtt_p50", &sleep, 50.0).extra("sleep_rtt_p99_ns", p(&sleep, 99.0)),
    ])
}

/// The pool side of the benchmark, in the child process.
pub fn peer(fd: i32, sock_fd: i32, rounds: usize) -> io::Result<()> {
    let l = layout();
    // SAFETY: the parent passed these fds open, and this process never closes them.
    let (fd, sock_fd) = unsafe { (inherited(fd), inherited(sock_fd)) };
    let map = SharedMemory::from_received(fd.try_clone_to_owned()?, l.total_bytes, true).map_err(io::Error::other)?;
    let Rings { sq, cq } = rings(&map, &l, false)?;
    let mut sq = sq.consumer();
    let mut cq = cq.producer();
    let mut sock = UnixStream::from(sock_fd.try_clone_to_owned()?);
    let mut buf = [0u8; MSG];
    for _ in 0..rounds {
        sock.read_exact(&mut buf)?;
        sock.write_all(&buf)?;
    }
    for sleep in [false, true] {
        for _ in 0..rounds {
            let s = if sleep { sleep_pop(&mut sq)? } else { spin_pop(&mut sq)? };
            let c = Cqe { user_data: s.user_data, ok_count: s.count, ..Zeroable::zeroed() };
            push(&mut cq, c)?;
        }
    }
    Ok(())
}
