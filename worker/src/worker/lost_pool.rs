//! A lost pool (docs/connection.md "A lost pool", "Dropping a worker"): abandoning the
//! transfers in flight, the started loads kept with the lost attachment until its pool
//! answers them or dies, and the drop's bounded wait for them.

use super::*;

impl Worker {
    /// Started loads of a lost attachment still holding their blocks: the pool's process
    /// lives, so its copies into them may still land (docs/connection.md "A lost pool").
    pub fn quarantined_count(&self) -> usize {
        self.quarantine.iter().map(|q| q.loads.len()).sum()
    }

    pub(super) fn quarantined(&self, id: u64) -> bool {
        self.quarantine.iter().any(|q| q.loads.contains_key(&id))
    }

    /// Drops the attachment (docs/connection.md "A lost pool"). Every transfer without a
    /// completion is abandoned first (its state word gets `ABANDONED`), so a pool that is
    /// still alive publishes nothing of it and starts no further stage. Stores and loads
    /// the pool never started have then failed and their blocks are the caller's again. A
    /// load the pool has started may still be copying into its blocks: it fails only once
    /// the pool's process is known dead; while it lives, the load keeps its blocks (it is
    /// quarantined with the old attachment) until the pool answers it there or dies.
    pub(super) fn lose(&mut self, why: &str) {
        let Some(mut conn) = self.conn.take() else { return };
        // Completions published before the pool went are real; keep them.
        let ring_broken = reap_into(&mut conn, &mut self.inflight, &mut self.abandoned, &mut self.ready).is_err();
        // Cancelled transfers' completions are dropped unseen; the arena goes with the attachment.
        self.abandoned.clear();
        let pool_dead = conn.pool_dead().unwrap_or_else(|| peer_gone(&conn.sock));
        let mut pending: Vec<(u64, InFlight)> = self.inflight.drain().collect();
        pending.sort_unstable_by_key(|(id, _)| *id);
        let mut held = HashMap::new();
        let mut gone = HashMap::new();
        for (id, f) in pending {
            let started = abandon(&conn, &f);
            if f.op == Opcode::Load && started && !pool_dead {
                held.insert(id, f);
                continue;
            }
            if f.op == Opcode::Load {
                // The pool will never write this load's fence word (or is dead).
                if let Some(fences) = &self.fences {
                    fences.release_load(id);
                }
            }
            self.ready.push_back(Completion::failed(id, f.count as usize, None));
            gone.insert(id, f);
        }
        tracing::warn!(
            endpoint = %self.cfg.endpoint.display(),
            attachment = conn.attachment_id,
            failed = gone.len(),
            quarantined = held.len(),
            pool_dead,
            "lost the UMBP pool ({why}); pending transfers abandoned and failed (started loads keep their blocks while the pool process lives), reconnecting"
        );
        if !held.is_empty() {
            // Kept open: a live pool completes the started stages on this attachment.
            self.quarantine.push(Quarantine { conn, loads: held, gone, ring_broken });
        }
        self.stall_warned = false;
        self.dial = None;
        self.backoff.reset();
    }

    /// Ends quarantined loads whose pool answered on the lost attachment or died.
    pub(super) fn check_quarantine(&mut self) {
        if self.quarantine.is_empty() {
            return;
        }
        for q in &mut self.quarantine {
            if !q.ring_broken {
                q.ring_broken = reap_into(&mut q.conn, &mut q.loads, &mut q.gone, &mut self.ready).is_err();
            }
            if !q.loads.is_empty() && q.pool_dead() {
                tracing::warn!(
                    attachment = q.conn.attachment_id,
                    loads = q.loads.len(),
                    "the lost UMBP pool's process is gone: its started loads failed, their blocks are free"
                );
                let mut ids: Vec<(u64, InFlight)> = q.loads.drain().collect();
                ids.sort_unstable_by_key(|(id, _)| *id);
                for (id, f) in ids {
                    if let Some(fences) = &self.fences {
                        fences.release_load(id);
                    }
                    self.ready.push_back(Completion::failed(id, f.count as usize, None));
                }
            }
        }
        self.quarantine.retain(|q| !q.loads.is_empty());
    }

    /// Closes the worker as dropping it does, but waits at most `wait` (not `timeout`) for
    /// loads the pool started: a caller with a shutdown budget of its own passes what is
    /// left of it, so that its shutdown stays within that budget.
    pub fn close_within(mut self, wait: Duration) {
        self.release(wait);
    }

    /// Abandons every transfer in flight and waits at most `wait` for started loads; past
    /// it they are given up (logged), so a later call returns at once.
    fn release(&mut self, wait: Duration) {
        if !self.inflight.is_empty() {
            self.lose("worker dropped");
        }
        if self.quarantine.is_empty() {
            return;
        }
        let deadline = Instant::now() + wait;
        loop {
            self.check_quarantine();
            if self.quarantine.is_empty() {
                return;
            }
            if Instant::now() >= deadline {
                tracing::error!(
                    loads = self.quarantined_count(),
                    waited_ms = wait.as_millis() as u64,
                    "UMBP worker dropped while the pool (alive, not answering) has started loads into its memory"
                );
                self.quarantine.clear();
                return;
            }
            std::thread::sleep(LIVENESS_SLICE.min(deadline - Instant::now()));
        }
    }
}

impl Drop for Worker {
    /// Abandons every transfer in flight (docs/connection.md "Dropping a worker"): a live
    /// pool publishes none of its stores and starts no further stage. Loads the pool has
    /// started may still be copying into registered memory, which must stay allocated
    /// until the `Worker` is dropped: the drop waits for them (their completion or the
    /// pool's death), at most `timeout`, and warns if one is still running then.
    fn drop(&mut self) {
        self.release(self.cfg.timeout);
    }
}
