//! Exponential backoff for reconnect attempts. Time is passed in so the policy is testable
//! without sleeping.

use std::time::{Duration, Instant};

/// First retry delay after a failed attempt.
pub const BACKOFF_MIN: Duration = Duration::from_millis(50);
/// Longest delay between attempts: a restarted pool is found within this.
pub const BACKOFF_MAX: Duration = Duration::from_secs(2);

#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    delay: Duration,
    next_at: Option<Instant>,
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new(BACKOFF_MIN, BACKOFF_MAX)
    }
}

impl Backoff {
    pub fn new(min: Duration, max: Duration) -> Self {
        Self { min, max: max.max(min), delay: min, next_at: None }
    }

    /// Whether an attempt may start at `now`.
    pub fn due(&self, now: Instant) -> bool {
        self.next_at.is_none_or(|t| now >= t)
    }

    /// Records a failed attempt at `now`; the next is allowed after the returned delay,
    /// and the delay after that doubles (up to the maximum).
    pub fn failed(&mut self, now: Instant) -> Duration {
        let d = self.delay;
        self.next_at = Some(now + d);
        self.delay = (self.delay * 2).min(self.max);
        d
    }

    /// Success (or a fresh loss after a healthy period): the next attempt may start at once
    /// and failures start again from the minimum delay.
    pub fn reset(&mut self) {
        self.delay = self.min;
        self.next_at = None;
    }

    /// When the next attempt is allowed (None: now).
    #[cfg(test)]
    pub fn next_at(&self) -> Option<Instant> {
        self.next_at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap_and_resets() {
        let t0 = Instant::now();
        let mut b = Backoff::default();
        assert!(b.due(t0));
        let delays: Vec<u64> = (0..8).map(|_| b.failed(t0).as_millis() as u64).collect();
        assert_eq!(delays, [50, 100, 200, 400, 800, 1600, 2000, 2000]);
        assert!(!b.due(t0 + Duration::from_millis(1999)));
        assert!(b.due(t0 + Duration::from_millis(2000)));
        b.reset();
        assert!(b.due(t0));
        assert_eq!(b.failed(t0), BACKOFF_MIN);
    }

    #[test]
    fn due_only_after_the_delay() {
        let t0 = Instant::now();
        let mut b = Backoff::default();
        b.failed(t0);
        assert!(!b.due(t0));
        assert!(!b.due(t0 + Duration::from_millis(49)));
        assert!(b.due(t0 + Duration::from_millis(50)));
        assert_eq!(b.next_at(), Some(t0 + Duration::from_millis(50)));
    }
}
