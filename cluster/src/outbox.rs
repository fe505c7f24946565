//! A connection's outgoing frames: queued without waiting by anyone, written by the
//! connection's own writer thread.
//!
//! Why: a peer that stops draining its connection (partitioned, stopped, overloaded) fills
//! the socket's send buffer, and a blocking write then waits out the write timeout. When
//! that write ran on a shared thread (the ticker's heartbeats, the pool's change stream, a
//! fetch's pins) under the connection's writer lock, one bad peer stalled heartbeats to
//! healthy peers (which then dropped this pool) and fetches far past their read budget
//! (`tests/tests/cluster_partition.rs`). Now only the writer thread ever blocks on the
//! socket; a queue that outgrows its byte bound closes that connection alone (its reader
//! then cleans up, and the peer re-joins with a fresh snapshot).

use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};

use crate::channel::Sealer;
use crate::control::{write_msg, Msg};

/// Queued bytes above which a connection is closed instead of queued to (a healthy peer
/// drains far faster; a snapshot, queued as a whole, is exempt).
pub const MAX_QUEUED_BYTES: usize = 64 << 20;

/// The sending half of one connection.
pub struct Outbox {
    tx: Mutex<mpsc::Sender<Vec<u8>>>,
    sock: TcpStream,
    shared: Arc<Shared>,
}

struct Shared {
    queued: AtomicUsize,
    closed: AtomicBool,
}

/// Holds the outbox's order: frames pushed through it go out together, before any frame
/// sent after it is dropped (a subscriber's snapshot and the changes that follow it).
pub struct Batch<'a> {
    tx: MutexGuard<'a, mpsc::Sender<Vec<u8>>>,
    outbox: &'a Outbox,
}

impl Outbox {
    /// Starts the writer thread for `sock` (named `thread_name`); it seals every frame
    /// with `sealer` (the connection's sending key: only this thread uses it, so the
    /// records' implicit nonces follow the queue's order).
    pub fn new(sock: &TcpStream, mut sealer: Sealer, thread_name: &str) -> std::io::Result<Arc<Self>> {
        let (tx, rx) = mpsc::channel::<Vec<u8>>();
        let shared = Arc::new(Shared { queued: AtomicUsize::new(0), closed: AtomicBool::new(false) });
        let mut out = sock.try_clone()?;
        let sh = shared.clone();
        std::thread::Builder::new().name(thread_name.into()).spawn(move || {
            // Ends when every sender is gone (the outbox dropped) or a write fails (the
            // socket's write timeout, or `close`).
            while let Ok(frame) = rx.recv() {
                if sealer.write_frames(&mut out, &frame).is_err() {
                    sh.closed.store(true, Ordering::Release);
                    let _ = out.shutdown(Shutdown::Both);
                    return;
                }
                sh.queued.fetch_sub(frame.len(), Ordering::AcqRel);
            }
        })?;
        Ok(Arc::new(Self { tx: Mutex::new(tx), sock: sock.try_clone()?, shared }))
    }

    /// Queues `m`; false (and the connection closed) when it cannot be: the connection is
    /// closed already, or the peer is so far behind that the queue passed its bound.
    pub fn send(&self, m: &Msg) -> bool {
        self.batch().push(m)
    }

    /// Holds the order for several frames (see [`Batch`]).
    pub fn batch(&self) -> Batch<'_> {
        Batch { tx: self.tx.lock().expect("outbox"), outbox: self }
    }

    /// Closes the connection both ways: the reader and the writer thread end.
    pub fn close(&self) {
        self.shared.closed.store(true, Ordering::Release);
        let _ = self.sock.shutdown(Shutdown::Both);
    }

    pub fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Acquire)
    }

    /// Bytes queued and not yet written.
    pub fn queued_bytes(&self) -> usize {
        self.shared.queued.load(Ordering::Acquire)
    }
}

impl Batch<'_> {
    /// Queues `m` within the byte bound (see [`Outbox::send`]).
    pub fn push(&mut self, m: &Msg) -> bool {
        self.enqueue(m, true)
    }

    /// Queues `m` whatever is queued already (a snapshot: bounded by the pool's keys).
    pub fn push_unbounded(&mut self, m: &Msg) -> bool {
        self.enqueue(m, false)
    }

    fn enqueue(&mut self, m: &Msg, bounded: bool) -> bool {
        let o = self.outbox;
        if o.is_closed() {
            return false;
        }
        let mut frame = Vec::new();
        if write_msg(&mut frame, m).is_err() {
            return false;
        }
        let len = frame.len();
        let before = o.shared.queued.fetch_add(len, Ordering::AcqRel);
        if bounded && before + len > MAX_QUEUED_BYTES {
            o.shared.queued.fetch_sub(len, Ordering::AcqRel);
            tracing::warn!(queued = before, "cluster connection not drained (peer partitioned or stopped?): closed");
            o.close();
            return false;
        }
        if self.tx.send(frame).is_err() {
            o.shared.queued.fetch_sub(len, Ordering::AcqRel);
            o.close();
            return false;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn pair() -> (TcpStream, Sealer, crate::channel::Opener<TcpStream>) {
        let (mut a, b) = crate::channel::test_pair();
        (a.opener.get_mut().try_clone().unwrap(), a.sealer, b.opener)
    }

    #[test]
    fn frames_arrive_in_order() {
        let (a, sealer, mut b) = pair();
        let o = Outbox::new(&a, sealer, "test-writer").unwrap();
        let msgs = [Msg::Heartbeat, Msg::Unpin { group: 1, namespace: 2, key: 3 }, Msg::Heartbeat];
        for m in &msgs {
            assert!(o.send(m));
        }
        b.get_mut().set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        for m in &msgs {
            assert_eq!(&crate::control::read_msg(&mut b, crate::control::MAX_FRAME).unwrap(), m);
        }
    }

    /// A peer that never reads: sending never blocks the caller, and once the queue passes
    /// its bound the connection is closed and later sends fail at once.
    #[test]
    fn an_undrained_peer_never_blocks_the_sender_and_is_closed_past_the_bound() {
        let (a, sealer, _b_never_read) = pair();
        let o = Outbox::new(&a, sealer, "test-writer").unwrap();
        let big = Msg::Keys {
            changes: vec![crate::catalog::KeyChange { group: 0, key: 7, stored: true, tier: 0, size: 1 << 20, namespace: 0 }; 4096],
            snapshot: false,
            more: false,
        };
        let t = Instant::now();
        let mut sent = 0usize;
        while o.send(&big) {
            sent += 1;
            assert!(sent < 100_000, "never closed");
        }
        assert!(t.elapsed() < Duration::from_secs(5), "the sender waited: {:?}", t.elapsed());
        assert!(o.is_closed());
        assert!(!o.send(&Msg::Heartbeat), "closed: refused at once");
    }
}
