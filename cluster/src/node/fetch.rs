//! A batched fetch: every pin in flight at once (over the holders' control connections),
//! each holder's answered pins read as soon as they add up to [`READ_CHUNK_BYTES`] (or all
//! its pins are answered), the reads of all holders in flight together, unpins after; all
//! within `read_timeout` (pins within half of it).
//!
//! Reading in chunks pipelines copy-on-pin: a holder answers each pin once it has copied
//! the object into its export area, so the read of one chunk overlaps the holder's copies
//! of the next objects instead of waiting for the whole batch to be copied.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::{FetchError, FetchRequest, Inner, Pin, PinReply, PinWaiter};
use crate::control::{self, Msg};
use crate::outbox::Outbox;
use crate::placement::NodeId;
use crate::transport::{self, PeerRegion, ReadPiece, TransportError};

/// Below this many bytes a stage's digests are taken on the fetching thread alone.
const PARALLEL_DIGEST_BYTES: usize = 8 << 20;
/// Most threads one stage's digests are taken on.
const MAX_DIGEST_THREADS: usize = 4;
/// A holder's answered pins are read once they add up to this many bytes (the pipeline's
/// step; large enough that a read's fixed cost is small against its transfer).
pub const READ_CHUNK_BYTES: u64 = 8 << 20;

/// xxh3-128 of each `(address, len)` range, in order. A large stage is split over a few
/// scoped threads (the check sits between the READ's completion and publishing, so its
/// time is the fetch's; the cores are otherwise idle then).
///
/// # Safety
/// Every range must be readable and not written while this runs.
unsafe fn digests_of(ranges: &[(usize, usize)]) -> Vec<u128> {
    // SAFETY: per this function's contract.
    let one = |&(at, len): &(usize, usize)| xxhash_rust::xxh3::xxh3_128(unsafe { std::slice::from_raw_parts(at as *const u8, len) });
    let total: usize = ranges.iter().map(|r| r.1).sum();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(MAX_DIGEST_THREADS).min(ranges.len());
    if total < PARALLEL_DIGEST_BYTES || threads <= 1 {
        return ranges.iter().map(one).collect();
    }
    std::thread::scope(|s| {
        let parts: Vec<_> =
            ranges.chunks(ranges.len().div_ceil(threads)).map(|c| s.spawn(move || c.iter().map(one).collect::<Vec<_>>())).collect();
        parts.into_iter().flat_map(|h| h.join().expect("a digest thread does not panic")).collect()
    })
}

/// One holder's part of a batched fetch: its writer, region, pin lease (a READ completing
/// later than this after the batch began is late) and (item index, pin id)s.
type HolderBatch = (Arc<Outbox>, PeerRegion, Duration, Vec<(usize, u64)>);

/// One holder's read in flight: the items it carries (indexes into the batch).
struct HolderRead<'a> {
    node: NodeId,
    /// When the batch started (its pins were sent after): the lease is counted from here.
    started: Instant,
    lease: Duration,
    writer: Arc<Outbox>,
    agent: String,
    mine: Vec<usize>,
    read: transport::PendingRead<'a>,
}

/// What settling a holder's read needs (whether or not its post succeeded).
struct ReadParts<'a> {
    node: NodeId,
    started: Instant,
    lease: Duration,
    writer: &'a Arc<Outbox>,
    agent: &'a str,
    mine: &'a [usize],
}

impl HolderRead<'_> {
    fn parts(&self) -> ReadParts<'_> {
        ReadParts { node: self.node, started: self.started, lease: self.lease, writer: &self.writer, agent: &self.agent, mine: &self.mine }
    }
}

impl Inner {
    /// Pins every item at its holder (all pins in flight at once), reads each holder's
    /// pinned items with one NIXL request, unpins. Per-item results.
    pub(super) unsafe fn fetch_batch(&self, group: u32, items: &[FetchRequest]) -> Vec<Result<u128, FetchError>> {
        let started = Instant::now();
        let deadline = started + self.cfg.read_timeout;
        let mut out: Vec<Option<Result<u128, FetchError>>> = (0..items.len()).map(|_| None).collect();
        let (tx, rx) = mpsc::channel::<(u64, PinReply)>();
        // Per holder: its writer, region and (item index, pin id).
        let mut by_node: HashMap<NodeId, HolderBatch> = HashMap::new();
        {
            let mut st = self.state.lock().expect("state");
            for (i, it) in items.iter().enumerate() {
                let Some(node) = st.catalog.source((group, it.key)) else {
                    out[i] = Some(Err(FetchError::NoHolder(it.key.0)));
                    continue;
                };
                let Some(p) = st.peers.get_mut(&node) else {
                    out[i] = Some(Err(FetchError::PeerGone(node)));
                    continue;
                };
                let Some(region) = p.region.clone() else {
                    out[i] = Some(Err(FetchError::PeerGone(node)));
                    continue;
                };
                let id = self.next_pin.fetch_add(1, Ordering::Relaxed);
                p.pending.insert(id, PinWaiter { tx: tx.clone(), id });
                // The holder's lease bounds a READ's safe end, and so does this node's budget.
                let lease = p.lease.map_or(self.cfg.read_timeout, |l| l.min(self.cfg.read_timeout));
                let e = by_node.entry(node).or_insert_with(|| (p.writer.clone(), region, lease, Vec::new()));
                e.3.push((i, id));
            }
        }
        drop(tx);
        let mut id_to: HashMap<u64, (NodeId, usize)> = HashMap::new();
        for (node, (w, _, _, v)) in &by_node {
            for &(i, id) in v {
                id_to.insert(id, (*node, i));
                if !w.send(&Msg::Pin { id, group, namespace: items[i].namespace, key: items[i].key.0, size: items[i].size }) {
                    out[i] = Some(Err(FetchError::PeerGone(*node)));
                }
            }
        }
        // Pin replies until every pin is answered, its peer is gone, or the pin deadline
        // (half the budget, so a read always has the other half). Each holder's read is
        // posted as soon as all its pins are answered, and the reads of all holders are in
        // flight together: a stopped or slow holder (at the pin or during its read) delays
        // only its own items, never the reads from the others (nor leaves them a read with
        // no time, which would fail them and quarantine their DRAM).
        let pin_deadline = deadline - self.cfg.read_timeout / 2;
        let mut pinned: HashMap<usize, Pin> = HashMap::new();
        let mut unanswered: HashMap<NodeId, usize> = HashMap::new();
        for &(node, i) in id_to.values() {
            if out[i].is_none() {
                *unanswered.entry(node).or_default() += 1;
            }
        }
        let mut open: usize = unanswered.values().sum();
        // Items whose read was posted (a holder's pins are read in chunks).
        let mut posted: HashSet<usize> = HashSet::new();
        let mut reads: Vec<HolderRead<'_>> = Vec::new();
        let mut pins_over = false;
        // When the last pin was answered (or the pins gave up): for the slow-fetch log.
        let mut pins_at: Option<Duration> = None;
        let mut backoff = transport::Backoff::default();
        loop {
            for (&node, batch) in &by_node {
                let fresh: Vec<usize> = batch
                    .3
                    .iter()
                    .map(|&(i, _)| i)
                    .filter(|i| pinned.contains_key(i) && out[*i].is_none() && !posted.contains(i))
                    .collect();
                let all_answered = pins_over || unanswered.get(&node).is_none_or(|&c| c == 0);
                if fresh.is_empty() || (!all_answered && fresh.iter().map(|&i| items[i].size).sum::<u64>() < READ_CHUNK_BYTES) {
                    continue;
                }
                posted.extend(&fresh);
                // SAFETY: forwarded from `Cluster::fetch_batch`'s contract.
                if let Some(r) = unsafe { self.post_holder_read(group, items, (node, started), (batch, fresh), &pinned, &mut out) } {
                    reads.push(r);
                }
            }
            reads.retain_mut(|r| !self.settle_if_done(group, items, r, &pinned, &mut out));
            if pins_over && reads.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                let mut dropped = HashSet::new();
                for r in reads.drain(..) {
                    // The read may still land: its destinations are quarantined under a
                    // tag of their own and its request is kept and polled until NIXL says
                    // it is final (node/given_up.rs); only then is that DRAM reused.
                    let parts =
                        ReadParts { node: r.node, started: r.started, lease: r.lease, writer: &r.writer, agent: &r.agent, mine: &r.mine };
                    let tag = self.give_up(r.read, parts.agent, r.mine.iter().map(|&i| (items[i].namespace, items[i].key)));
                    let e = TransportError::Timeout { peer: tag, timeout: self.cfg.read_timeout };
                    self.settle_holder_read(group, items, &parts, &pinned, Err(e), &mut out);
                    // A holder whose read outlived the budget is dropped (it re-joins at
                    // the next dial, through a new endpoint): its keys miss meanwhile
                    // instead of timing out again.
                    if dropped.insert(r.node) {
                        tracing::warn!(
                            node = format!("{:016x}", r.node),
                            agent = %r.agent,
                            "a remote read outlived its budget: dropping that peer (it re-joins); the read's DRAM stays quarantined until NIXL reports the read final"
                        );
                        self.drop_peer(r.node, &r.writer);
                    }
                }
                break;
            }
            if pins_over || open == 0 {
                pins_over = true;
                pins_at.get_or_insert_with(|| started.elapsed());
                backoff.wait();
                continue;
            }
            // Waiting for pins; poll the reads in flight meanwhile.
            let wait =
                if reads.is_empty() { control::left(pin_deadline) } else { Duration::from_micros(200).min(control::left(pin_deadline)) };
            match rx.recv_timeout(wait) {
                Ok((id, r)) => {
                    let Some(&(node, i)) = id_to.get(&id) else { continue };
                    if out[i].is_some() || pinned.contains_key(&i) {
                        continue;
                    }
                    open -= 1;
                    if let Some(c) = unanswered.get_mut(&node) {
                        *c -= 1;
                    }
                    match r {
                        Ok(v) => {
                            pinned.insert(i, v);
                        }
                        Err(reason) => out[i] = Some(Err(FetchError::PinRefused { peer: node, key: items[i].key.0, reason })),
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() < pin_deadline => {}
                Err(_) => {
                    // Pin deadline, or every waiting peer gone: the unanswered pins fail;
                    // holders with some pins answered are read for what they pinned.
                    pins_over = true;
                    pins_at.get_or_insert_with(|| started.elapsed());
                    self.fail_unanswered_pins(items, &id_to, &pinned, pin_deadline, &mut out);
                }
            }
        }
        let took = started.elapsed();
        if took > self.cfg.read_timeout / 2 {
            // Where a slow fetch spent its budget (pins vs. reads), for an operator and for
            // a test that fails on it.
            let failed = out.iter().filter(|r| !matches!(r, Some(Ok(_)))).count();
            tracing::warn!(
                items = items.len(),
                failed,
                holders = by_node.len(),
                pins_ms = pins_at.unwrap_or(took).as_millis() as u64,
                took_ms = took.as_millis() as u64,
                budget_ms = self.cfg.read_timeout.as_millis() as u64,
                "slow remote fetch"
            );
        }
        out.into_iter().map(|r| r.unwrap_or(Err(FetchError::Read("not attempted".into())))).collect()
    }

    /// Fails every pin of the batch with no answer: the peer is gone, or it timed out.
    fn fail_unanswered_pins(
        &self,
        items: &[FetchRequest],
        id_to: &HashMap<u64, (NodeId, usize)>,
        pinned: &HashMap<usize, Pin>,
        pin_deadline: Instant,
        out: &mut [Option<Result<u128, FetchError>>],
    ) {
        let mut st = self.state.lock().expect("state");
        for (&id, &(node, i)) in id_to {
            if out[i].is_some() || pinned.contains_key(&i) {
                continue;
            }
            let gone = st.peers.get_mut(&node).is_none_or(|p| p.pending.remove(&id).is_none());
            out[i] = Some(Err(if gone && Instant::now() < pin_deadline {
                FetchError::PeerGone(node)
            } else {
                FetchError::PinTimeout { peer: node, key: items[i].key.0, timeout: self.cfg.read_timeout / 2 }
            }));
        }
    }

    /// Posts one NIXL read of the items `mine` (pinned at `batch`'s holder `node`; the batch
    /// began at `started`); None when the post failed (those items' results are then filled).
    ///
    /// # Safety
    /// As for [`Cluster::fetch_batch`], for every item's destination.
    unsafe fn post_holder_read(
        &self,
        group: u32,
        items: &[FetchRequest],
        (node, started): (NodeId, Instant),
        (batch, mine): (&HolderBatch, Vec<usize>),
        pinned: &HashMap<usize, Pin>,
        out: &mut [Option<Result<u128, FetchError>>],
    ) -> Option<HolderRead<'_>> {
        let &(ref w, ref region, lease, _) = batch;
        let pieces: Vec<ReadPiece> =
            mine.iter().map(|&i| ReadPiece { remote_offset: pinned[&i].offset, local: items[i].dest, len: items[i].size }).collect();
        self.reads_in_flight.fetch_add(1, Ordering::AcqRel);
        self.read_busy.lock().expect("read busy").posted();
        // Its pins were sent at the batch's start and are all answered now: the holder's
        // copies into its export area, their queue and the round trip.
        // Relaxed: a counter for reports; it orders nothing.
        self.phase_pin_ns.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        // SAFETY: forwarded from this function's contract; the read is polled to its end
        // or given up as tainted (`settle_holder_read`).
        match unsafe { self.agent.post_read(region, &pieces) } {
            Ok(read) => Some(HolderRead { node, started, lease, writer: w.clone(), agent: region.agent.clone(), mine, read }),
            Err(e) => {
                let parts = ReadParts { node, started, lease, writer: w, agent: &region.agent, mine: &mine };
                self.settle_holder_read(group, items, &parts, pinned, Err(e), out);
                None
            }
        }
    }

    /// Polls `r`; once it is done (or failed), unpins and fills its items. True when settled.
    fn settle_if_done(
        &self,
        group: u32,
        items: &[FetchRequest],
        r: &mut HolderRead<'_>,
        pinned: &HashMap<usize, Pin>,
        out: &mut [Option<Result<u128, FetchError>>],
    ) -> bool {
        let result = match r.read.poll() {
            Ok(false) => return false,
            Ok(true) => Ok(()),
            Err(e) => Err(e),
        };
        // Relaxed: a counter for reports; it orders nothing.
        self.phase_read_ns.fetch_add(r.read.since_posted().as_nanos() as u64, Ordering::Relaxed);
        self.settle_holder_read(group, items, &r.parts(), pinned, result, out);
        true
    }

    /// The unpins and the items' results of one holder's read.
    fn settle_holder_read(
        &self,
        group: u32,
        items: &[FetchRequest],
        r: &ReadParts<'_>,
        pinned: &HashMap<usize, Pin>,
        result: Result<(), TransportError>,
        out: &mut [Option<Result<u128, FetchError>>],
    ) {
        self.reads_in_flight.fetch_sub(1, Ordering::AcqRel);
        self.read_busy.lock().expect("read busy").settled();
        for &i in r.mine {
            // Best effort: a dead peer released its pins with its connection.
            r.writer.send(&Msg::Unpin { group, namespace: items[i].namespace, key: items[i].key.0 });
        }
        // A read is safe only within the holder's pin lease: the holder keeps a closed
        // subscriber's pins for its lease (`read_timeout` + a margin, sent in its `Join`)
        // after the close, and the close comes after the pin, which comes after `started`.
        // A read seen complete past `started` + the lease (or this node's `read_timeout`,
        // if shorter: the poll raced the deadline, or a slow settle) may have read a range
        // already reused: not published (issue #35 C1).
        let took = r.started.elapsed();
        if result.is_ok() && took > r.lease {
            for &i in r.mine {
                // Relaxed: a counter for reports; it orders nothing.
                self.late_reads.fetch_add(1, Ordering::Relaxed);
                out[i] = Some(Err(FetchError::Late { peer: r.node, key: items[i].key.0, took, lease: r.lease }));
            }
            return;
        }
        match result {
            Ok(()) => {
                let ranges: Vec<(usize, usize)> = r.mine.iter().map(|&i| (items[i].dest as usize, items[i].size as usize)).collect();
                let checking = Instant::now();
                // SAFETY: the read into every `dest..dest+size` completed; each range is
                // reserved for this fetch (`Cluster::fetch_batch`'s contract) and nothing
                // else writes it until this fetch returns.
                let digests = unsafe { digests_of(&ranges) };
                // Relaxed: counters for reports; they order nothing.
                self.phase_check_ns.fetch_add(checking.elapsed().as_nanos() as u64, Ordering::Relaxed);
                self.phase_reads.fetch_add(1, Ordering::Relaxed);
                for (&i, digest) in r.mine.iter().zip(digests) {
                    let p = pinned[&i];
                    out[i] = Some(if digest == p.digest {
                        Ok(p.namespace)
                    } else {
                        // Relaxed: a counter for reports; it orders nothing.
                        self.digest_mismatches.fetch_add(1, Ordering::Relaxed);
                        Err(FetchError::Digest { peer: r.node, key: items[i].key.0, expected: p.digest, got: digest })
                    });
                }
            }
            Err(e) => {
                let msg = e.to_string();
                tracing::debug!(node = format!("{:016x}", r.node), agent = %r.agent, "remote read failed: {msg}");
                for &i in r.mine {
                    out[i] = Some(Err(match &e {
                        // Given up (`give_up`): the tag it is quarantined under.
                        TransportError::Timeout { peer, timeout } => {
                            FetchError::Transport(TransportError::Timeout { peer: peer.clone(), timeout: *timeout })
                        }
                        _ => FetchError::Read(msg.clone()),
                    }));
                }
            }
        }
    }
}
