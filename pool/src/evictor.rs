//! Background eviction between the watermarks, so the store path never evicts itself.

use std::time::{Duration, Instant};

use crate::PoolInner;

pub fn run(inner: &PoolInner) {
    let cap = inner.config.capacity_bytes as f64;
    let high = (cap * inner.config.high_watermark) as u64;
    let low = (cap * inner.config.low_watermark) as u64;
    let (lock, cv) = &inner.evict_wake;
    while !inner.is_shutting_down() {
        {
            let mut woken = lock.lock().expect("evictor lock");
            if !*woken {
                woken = cv.wait_timeout(woken, Duration::from_millis(20)).expect("evictor lock").0;
            }
            *woken = false;
        }
        let mut store = inner.store.lock().expect("store lock");
        if store.allocated_bytes() > high {
            let before = store.allocated_bytes();
            let n = store.evict_to(low, Instant::now());
            tracing::debug!(evicted = n, before, after = store.allocated_bytes(), "evicted to the low watermark");
        }
    }
}
