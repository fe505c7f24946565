//! Eviction under pressure: storing 3x the pool's capacity never blocks, occupancy comes
//! back within the watermarks, and every load is either the exact bytes or "missing".

mod common;
use common::*;

#[test]
fn fill_three_times_capacity() {
    let cap = EVICTING_POOL_BYTES;
    let pool = PoolProcess::start(&unique_socket("evict"), &EVICTING_POOL);
    // 16 KiB objects (4 layers x 4 KiB), 3x capacity in total.
    let count = 3 * cap / (16 << 10);
    let r = run_worker(&pool.socket, 1, "per-layer", &["store", "--first-key", "0", "--count", &count.to_string()]);
    assert_eq!(n(&r, "failed"), 0, "{r}");
    assert_eq!(n(&r, "stored") + n(&r, "not_stored"), count, "{r}");
    assert!(n(&r, "stored") > count / 2, "most stores find room thanks to the evictor: {r}");
    assert!(n(&r, "max_wait_ms") < 2000, "a store waited {} ms: stores must never block on eviction", n(&r, "max_wait_ms"));
    let high = (cap as f64 * 0.9) as u64;
    assert!(
        eventually(std::time::Duration::from_secs(5), || pool.report().pool.allocated_bytes <= high),
        "occupancy stayed above the high watermark: {}",
        pool.report().pool
    );
    let report = pool.report();
    assert!(report.pool.evictions > 0);
    // Everything ever stored loads exact or is reported missing; the newest survive.
    let l = run_worker(&pool.socket, 1, "per-layer", &["load", "--first-key", "0", "--count", &count.to_string()]);
    assert_eq!(n(&l, "corrupt"), 0, "{l}");
    assert_eq!(n(&l, "failed"), 0, "{l}");
    assert_eq!(n(&l, "loaded") + n(&l, "missing"), count, "{l}");
    assert!(n(&l, "loaded") > 0 && n(&l, "missing") > 0, "{l}");
}

/// 1.5 MiB objects fit one per 2 MiB slab page: the evictor must see the page waste as
/// used memory, or a full pool would read 75% and never evict (found on the H200).
#[test]
fn objects_that_waste_page_space_still_evict() {
    let pool = PoolProcess::start(&unique_socket("evict-big"), &["--capacity", "64MiB", "--min-object-size", "1MiB"]);
    let page = (512 << 10).to_string();
    let count = 3 * 32u64; // three pools' worth of 2 MiB pages
    let r = run_worker(
        &pool.socket,
        1,
        "per-layer",
        &["--layers", "3", "--page", &page, "--blocks", "8", "store", "--first-key", "0", "--count", &count.to_string()],
    );
    assert_eq!(n(&r, "failed"), 0, "{r}");
    assert!(n(&r, "stored") > count / 2, "the evictor made room: {r}");
    assert!(pool.report().pool.evictions > 0);
}
