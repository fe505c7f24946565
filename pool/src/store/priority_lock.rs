//! A mutex whose urgent takers go first when a background holder reaches a yield point.
//!
//! The object store's lock is taken by the copy threads for short holds that sit on a
//! transfer's critical path (a stage's reservations and publication), and by background
//! work that holds it for long batches: the service thread applies a scheduler's touch
//! hints, about 0.35 µs each, and a prefix lookup of a 10k-token prefix posts 625 of them
//! right before the worker submits the load of the same prefix. One batch held the first
//! stage of that load for a quarter of a millisecond. A plain mutex cannot help: the
//! background thread that unlocks and locks again wins over the woken waiter. Here an
//! urgent taker announces itself; a background holder that offers the lock between batches
//! ([`PriorityMutex::yield_to_urgent`]) steps aside until the urgent takers had their turn.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{LockResult, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

/// How long an urgent taker spins for the lock before it sleeps on it: longer than one
/// background batch (32 touch hints, 64 evictions: 10-110 µs on the 2-core VM).
pub const URGENT_SPIN: Duration = Duration::from_micros(50);

/// How long a background holder (the hint drain, the evictor) stays out of the lock at a
/// yield point for urgent takers that keep coming: then its own work goes on.
pub const BACKGROUND_YIELD_PATIENCE: Duration = Duration::from_millis(1);

pub struct PriorityMutex<T> {
    mutex: Mutex<T>,
    /// Urgent takers waiting for the lock now.
    urgent_waiting: AtomicU32,
}

impl<T> PriorityMutex<T> {
    pub fn new(value: T) -> Self {
        Self { mutex: Mutex::new(value), urgent_waiting: AtomicU32::new(0) }
    }

    /// An ordinary take: waits like [`Mutex::lock`].
    pub fn lock(&self) -> LockResult<MutexGuard<'_, T>> {
        self.mutex.lock()
    }

    /// A take on a transfer's critical path: background holders step aside at their next
    /// yield point. Spins for up to [`URGENT_SPIN`] before it sleeps: a background batch
    /// ends within microseconds, and a thread asleep on the lock pays a futex wake-up
    /// (tens of microseconds on a VM) to get it.
    pub fn lock_urgent(&self) -> LockResult<MutexGuard<'_, T>> {
        self.urgent_waiting.fetch_add(1, Ordering::SeqCst);
        let spin_until = Instant::now() + URGENT_SPIN;
        let guard = loop {
            match self.mutex.try_lock() {
                Ok(g) => break Ok(g),
                Err(TryLockError::Poisoned(p)) => break Err(p),
                Err(TryLockError::WouldBlock) if Instant::now() < spin_until => std::hint::spin_loop(),
                Err(TryLockError::WouldBlock) => break self.mutex.lock(),
            }
        };
        self.urgent_waiting.fetch_sub(1, Ordering::SeqCst);
        guard
    }

    /// Between two batches of background work: while urgent takers wait, releases the
    /// lock until they all had it (or `patience` ran out, so a stream of urgent takers
    /// cannot starve the background work), then takes it again.
    pub fn yield_to_urgent<'a>(&'a self, guard: MutexGuard<'a, T>, patience: Duration) -> LockResult<MutexGuard<'a, T>> {
        if self.urgent_waiting.load(Ordering::SeqCst) == 0 {
            return Ok(guard);
        }
        drop(guard);
        let since = Instant::now();
        while self.urgent_waiting.load(Ordering::SeqCst) > 0 && since.elapsed() < patience {
            std::thread::yield_now();
        }
        self.mutex.lock()
    }

    /// Urgent takers waiting now.
    #[cfg(test)]
    pub fn urgent_waiting(&self) -> u32 {
        self.urgent_waiting.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    /// A background holder applies 1,000 items in batches of 10 with a yield point between
    /// batches; an urgent taker that arrives during the first batch gets the lock at the
    /// next yield point, long before the background work ends. With a plain unlock and
    /// lock between batches it would usually wait for all of them.
    #[test]
    fn an_urgent_taker_goes_first_at_the_next_yield_point() {
        const ITEMS: usize = 1_000;
        let lock = Arc::new(PriorityMutex::new(0usize));
        let applied = Arc::new(AtomicUsize::new(0));
        let mut guard = lock.lock().unwrap();
        let urgent = {
            let (lock, applied) = (lock.clone(), applied.clone());
            std::thread::spawn(move || {
                let g = lock.lock_urgent().unwrap();
                // What the background holder had applied when the urgent taker got in.
                (*g, applied.load(Ordering::SeqCst))
            })
        };
        // Wait until the urgent taker is queued, so the test does not depend on timing.
        while lock.urgent_waiting() == 0 {
            std::thread::yield_now();
        }
        for batch in 0..ITEMS / 10 {
            for _ in 0..10 {
                *guard += 1;
                applied.fetch_add(1, Ordering::SeqCst);
            }
            if batch < ITEMS / 10 - 1 {
                guard = lock.yield_to_urgent(guard, Duration::from_secs(60)).unwrap();
            }
        }
        drop(guard);
        let (seen, applied_then) = urgent.join().unwrap();
        assert_eq!(seen, 10, "the urgent taker got the lock at the first yield point");
        assert_eq!(applied_then, 10);
        assert_eq!(*lock.lock().unwrap(), ITEMS, "the background work still ran to the end");
    }

    /// With nobody waiting, a yield point keeps the lock (no unlock, no relock).
    #[test]
    fn a_yield_point_without_urgent_takers_keeps_the_lock() {
        let lock = PriorityMutex::new(1u32);
        let g = lock.lock().unwrap();
        let g = lock.yield_to_urgent(g, Duration::ZERO).unwrap();
        assert!(lock.mutex.try_lock().is_err(), "still held");
        drop(g);
        assert_eq!(lock.urgent_waiting(), 0);
    }

    /// Patience bounds the wait: urgent takers that keep coming do not starve the holder.
    #[test]
    fn patience_bounds_the_wait_for_urgent_takers() {
        let lock = PriorityMutex::new(());
        // An urgent taker that never gets in (counted, but blocked elsewhere): stands for
        // a stream of them.
        lock.urgent_waiting.fetch_add(1, Ordering::SeqCst);
        let g = lock.lock().unwrap();
        let t = Instant::now();
        let g = lock.yield_to_urgent(g, Duration::from_millis(20)).unwrap();
        let waited = t.elapsed();
        assert!(waited >= Duration::from_millis(20), "waited {waited:?}: the holder stepped aside for its patience");
        assert!(waited < Duration::from_secs(5), "waited {waited:?}: patience bounds the wait");
        drop(g);
    }
}
