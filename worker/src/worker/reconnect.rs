//! Re-attaching (docs/connection.md "A lost pool", "A restarted pool"): the non-blocking
//! reconnect with backoff, replaying registrations and layouts within one timeout, and
//! what a caller drives by hand (`maintain`, `disconnect`, `reconnect_now`).

use super::*;

impl Worker {
    /// Keeps the attachment while the caller is idle: reaps completions (kept for
    /// [`Self::poll`]), notices a lost or stalled pool, and re-dials a restarted one (with
    /// the backoff; the re-attach re-registers memory and layouts). A worker that submits
    /// nothing otherwise learns of a restarted pool only at its next call, and that call's
    /// transfers fail; an engine's background timer calls this so the next request finds it
    /// attached (docs/connection.md "A restarted pool").
    pub fn maintain(&mut self) {
        self.service();
    }

    /// Drops the attachment as if the pool were lost, with the pool alive (an engine-side
    /// reset; the soak's "worker lose on a live pool"): every transfer in flight is
    /// abandoned, stores and unstarted loads complete as failed at once, started loads keep
    /// their blocks until the pool answers them or dies (docs/connection.md "A lost
    /// pool"). The next call reconnects.
    pub fn disconnect(&mut self) {
        self.reap();
        self.lose("disconnected by the caller");
    }

    /// Reconnects now, ignoring the backoff, and waits for the handshake (up to `timeout`)
    /// and re-registration. A no-op while attached to a live pool.
    pub fn reconnect_now(&mut self) -> Result<(), WorkerError> {
        self.reap();
        self.check_alive();
        if self.conn.is_some() {
            return Ok(());
        }
        self.dial = None;
        let result = match Dial::blocking(&self.cfg.endpoint, &self.cfg.hello(), self.cfg.timeout, self.cfg.pool_uid) {
            Ok(a) => self.finish_reconnect(a, Instant::now() + self.cfg.timeout),
            Err(DialError::Refused(refusal)) => Err(WorkerError::Refused { message: refusal.to_string() }),
            Err(e) => Err(WorkerError::Unreachable { path: self.cfg.endpoint.clone(), source: e.into_io() }),
        };
        if let Err(e) = &result {
            let delay = self.backoff.failed(Instant::now());
            tracing::warn!(endpoint = %self.cfg.endpoint.display(), error = %e, ?delay, "UMBP reconnect failed");
        }
        result
    }

    /// Advances a reconnect without waiting: starts a dial when the backoff allows, or
    /// looks for the reply of one in progress; a replay that follows ends by `deadline`
    /// (the calling engine thread's own bound).
    pub(super) fn try_reconnect(&mut self, deadline: Instant) {
        let now = Instant::now();
        if self.dial.is_none() {
            if !self.backoff.due(now) {
                return;
            }
            match Dial::start(&self.cfg.endpoint, &self.cfg.hello(), self.cfg.timeout, self.cfg.pool_uid) {
                Ok(d) => self.dial = Some(d),
                Err(e) => {
                    let delay = self.backoff.failed(now);
                    tracing::debug!(endpoint = %self.cfg.endpoint.display(), error = %e, ?delay, "UMBP pool not reachable yet");
                    return;
                }
            }
        }
        let Some(dial) = self.dial.as_mut() else { return };
        let attached = match dial.finish(Duration::ZERO) {
            Ok(None) => return,
            Ok(Some((reply, fds))) => self.dial.take().expect("dial in progress").into_attached(reply, fds),
            Err(e) => {
                self.dial = None;
                let delay = self.backoff.failed(Instant::now());
                match e {
                    DialError::Refused(_) => {
                        tracing::warn!(endpoint = %self.cfg.endpoint.display(), error = %e, ?delay, "UMBP pool refused the reconnect")
                    }
                    _ => tracing::debug!(endpoint = %self.cfg.endpoint.display(), error = %e, ?delay, "UMBP reconnect failed"),
                }
                return;
            }
        };
        if let Err(e) = self.finish_reconnect(attached, deadline) {
            let delay = self.backoff.failed(Instant::now());
            tracing::warn!(endpoint = %self.cfg.endpoint.display(), error = %e, ?delay, "UMBP re-registration failed");
        }
    }

    /// Maps the new attachment and replays registrations and layouts (blocking: the pool
    /// has just shown it is alive by answering Hello). The whole replay shares one
    /// `timeout`: a pool that answers slowly after its Hello reply must not hold the calling
    /// engine thread for up to one timeout per message (found by `umbp-bench soak`: calls
    /// blocked 2.1 s with timeout_ms 1000, 3.6 s under valgrind; tests/tests/reconnect_stall.rs).
    /// A pool too slow to finish the replay by `deadline` is retried with backoff.
    ///
    /// The replay aims `TIMER_SLACK` early, for what follows its last wait (dropping a
    /// half-made attachment, the log line). Its waits are `poll`'s (umbp_ipc::message): with
    /// SO_RCVTIMEO, which the kernel fires late by up to an eighth of the wait, calls of the
    /// `soak --cluster` runs ended 20-23 ms past their 1,000 ms bound.
    pub(super) fn finish_reconnect(&mut self, attached: Attached, deadline: Instant) -> Result<(), WorkerError> {
        const TIMER_SLACK: Duration = Duration::from_millis(10);
        let began = Instant::now();
        let mut conn = Connection::new(attached)?;
        let deadline = deadline.checked_sub(TIMER_SLACK).unwrap_or(deadline);
        let left = || {
            let d = deadline.saturating_duration_since(Instant::now());
            if d.is_zero() {
                Err(WorkerError::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, "re-registration took longer than timeout_ms")))
            } else {
                Ok(d)
            }
        };
        for m in &self.memory {
            let id = conn.register_memory(&m.reg, m.fd.as_ref().map(|f| f.as_fd()), left()?)?;
            conn.alloc_ids.insert(m.id, id);
        }
        for (&group, segments) in &self.layouts {
            conn.register_layout(group, segments, left()?)?;
        }
        tracing::info!(
            endpoint = %self.cfg.endpoint.display(),
            attachment = conn.attachment_id,
            allocations = self.memory.len(),
            layouts = self.layouts.len(),
            replay_ms = began.elapsed().as_millis() as u64,
            "reattached to UMBP pool and re-registered"
        );
        self.conn = Some(conn);
        self.backoff.reset();
        Ok(())
    }

    /// Passes a control result on, dropping the attachment when the exchange broke the
    /// socket (closed, garbage): its byte stream can no longer be trusted to be in step.
    pub(super) fn after_control<T>(&mut self, result: Result<T, WorkerError>) -> Result<T, WorkerError> {
        match result {
            Err(e @ (WorkerError::Disconnected | WorkerError::Io(_) | WorkerError::Protocol(_))) => {
                self.lose(&e.to_string());
                Err(e)
            }
            other => other,
        }
    }
}
