//! How long the pool's idle threads poll for work before they sleep (`--idle-poll-us`).
//!
//! A transfer that finds the pool asleep pays two thread wake-ups before its first byte
//! moves (the service thread's, then a copy thread's): tens to hundreds of µs each on a VM,
//! whose halted vCPU the host must reschedule. Polling through the gap between a worker's
//! transfers removes them, at the price of a busy core while the gaps are short.
//!
//! `auto` adapts the window as KVM's halt polling does: it grows when work woke a thread
//! soon after it slept (a longer poll would have caught it) and shrinks when the thread
//! slept longer than the most it may poll (polling would only have burned the core). So a
//! pool whose workers submit back to back polls between their transfers; an idle pool, or
//! one whose engines submit once per long step, sleeps after [`SHORT_POLL`].

use std::time::Duration;

use crate::config::IdlePoll;

/// How long an idle thread spins (a spin hint per look) before it yields between looks,
/// and the shortest window `auto` polls.
pub(crate) const SHORT_POLL: Duration = Duration::from_micros(50);

/// The window to start with in `mode`.
pub(crate) fn initial_window(mode: IdlePoll) -> Duration {
    match mode {
        IdlePoll::Fixed(window) => window,
        IdlePoll::Auto { max } => SHORT_POLL.min(max),
    }
}

/// The next window after a thread polled `window`, slept, and was woken by work `gap`
/// after the pool's last activity (its last work or last completion). A fixed window stays.
pub(crate) fn after_sleep(mode: IdlePoll, window: Duration, gap: Duration) -> Duration {
    let IdlePoll::Auto { max } = mode else {
        return initial_window(mode);
    };
    let floor = SHORT_POLL.min(max);
    if gap > max {
        // Polling up to `max` would not have caught it.
        (window / 2).clamp(floor, max)
    } else if gap > window {
        // One miss is enough to cover a gap like it next time (a quarter's margin for
        // jitter); doubling at least, so a string of growing gaps does not miss each time.
        (window * 2).max(gap + gap / 4).clamp(floor, max)
    } else {
        window.clamp(floor, max)
    }
}

/// Whether the pool's threads should poll after a completion in `window`: the service
/// thread, asleep through a long copy, is woken for it (a doorbell costs the copy thread a
/// few µs) only when the pool is polling longer than its short spin.
pub(crate) fn polls_after_completion(window: Duration) -> bool {
    window > SHORT_POLL
}

/// Process time as the threads share it: ns since the pool started.
pub(crate) fn ns_since(start: std::time::Instant) -> u64 {
    start.elapsed().as_nanos() as u64
}

/// Whether a service or copy thread idle for `idle` keeps polling, its poll lasting
/// `window`; if so, it pauses briefly first: a spin hint for the first [`SHORT_POLL`], a
/// yield after, so a long poll never starves the threads it shares a core with (a small
/// machine).
pub(crate) fn poll_pause(idle: Duration, window: Duration) -> bool {
    if idle >= window {
        return false;
    }
    if idle < SHORT_POLL {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);
    const AUTO: IdlePoll = IdlePoll::Auto { max: Duration::from_millis(1) };

    #[test]
    fn a_fixed_window_never_moves() {
        let fixed = IdlePoll::Fixed(300 * US);
        assert_eq!(initial_window(fixed), 300 * US);
        for gap in [10 * US, 200 * US, 5_000 * US] {
            assert_eq!(after_sleep(fixed, 300 * US, gap), 300 * US);
        }
        assert_eq!(initial_window(IdlePoll::Fixed(Duration::ZERO)), Duration::ZERO);
    }

    #[test]
    fn auto_starts_at_the_short_spin() {
        assert_eq!(initial_window(AUTO), SHORT_POLL);
        assert_eq!(initial_window(IdlePoll::Auto { max: 20 * US }), 20 * US, "never past its max");
    }

    #[test]
    fn a_gap_just_missed_is_caught_next_time() {
        // Back-to-back transfers 200 µs apart: one miss, then the window covers them.
        let w = after_sleep(AUTO, SHORT_POLL, 200 * US);
        assert!(w >= 200 * US && w <= 300 * US, "{w:?}");
        assert_eq!(after_sleep(AUTO, w, 200 * US), w, "caught: the window stays");
        // A small gap that was slept through (the thread slept early) doubles it.
        assert_eq!(after_sleep(AUTO, 60 * US, 70 * US), 120 * US);
    }

    #[test]
    fn growth_stops_at_the_max() {
        let mut w = initial_window(AUTO);
        for _ in 0..20 {
            w = after_sleep(AUTO, w, 900 * US);
        }
        assert_eq!(w, Duration::from_millis(1));
        assert_eq!(after_sleep(AUTO, w, Duration::from_millis(1)), w);
    }

    #[test]
    fn long_sleeps_shrink_it_back_to_the_short_spin() {
        let mut w = Duration::from_millis(1);
        let mut steps = 0;
        while w > SHORT_POLL {
            w = after_sleep(AUTO, w, Duration::from_millis(30));
            steps += 1;
            assert!(steps < 10, "shrinks by halves");
        }
        assert_eq!(w, SHORT_POLL, "never below it");
        assert_eq!(after_sleep(AUTO, w, Duration::from_secs(5)), SHORT_POLL);
    }

    #[test]
    fn a_window_outside_the_mode_is_clamped_at_the_next_sleep() {
        assert_eq!(after_sleep(AUTO, Duration::from_secs(1), 10 * US), Duration::from_millis(1));
        assert_eq!(after_sleep(IdlePoll::Fixed(80 * US), Duration::from_millis(1), 10 * US), 80 * US);
    }

    #[test]
    fn only_a_long_window_wakes_the_service_thread_for_completions() {
        assert!(!polls_after_completion(SHORT_POLL));
        assert!(!polls_after_completion(Duration::ZERO));
        assert!(polls_after_completion(SHORT_POLL + US));
    }
}
