//! Two worker processes with different KV layouts share objects through one pool
//! process, byte-exact; a third process in another namespace sees none of them.

mod common;
use common::*;

#[test]
fn layouts_share_objects_and_namespaces_isolate() {
    let pool = PoolProcess::start(&unique_socket("xproc"), &["--capacity", "64MiB", "--min-object-size", "16KiB"]);
    let s = &pool.socket;
    let a = run_worker(s, 1, "per-layer", &["store", "--first-key", "0", "--count", "200"]);
    assert_eq!((n(&a, "stored"), n(&a, "failed")), (200, 0), "{a}");
    // Same objects, another process with another stride.
    let b = run_worker(s, 1, "strided", &["load", "--first-key", "0", "--count", "200"]);
    assert_eq!((n(&b, "loaded"), n(&b, "corrupt"), n(&b, "missing")), (200, 0, 0), "{b}");
    // And a cross-layer layout (one segment) reads the same bytes.
    let c = run_worker(s, 1, "cross", &["load", "--first-key", "150", "--count", "100"]);
    assert_eq!((n(&c, "loaded"), n(&c, "missing"), n(&c, "corrupt")), (50, 50, 0), "{c}");
    // First writer wins: storing again copies nothing.
    let again = run_worker(s, 1, "cross", &["store", "--first-key", "0", "--count", "64"]);
    assert_eq!(n(&again, "already_present"), 64, "{again}");
    // Another namespace: same block hashes, different keys.
    let other = run_worker(s, 2, "per-layer", &["load", "--first-key", "0", "--count", "64"]);
    assert_eq!((n(&other, "missing"), n(&other, "loaded")), (64, 0), "{other}");
    let report = pool.report();
    assert_eq!(report.pool.published_objects, 200, "{report}");
    assert_eq!(report.namespaces.len(), 1);
}

/// Submissions cut into many stages (`--copy-stage-size` of two objects, so up to 64
/// stages, each reserved, copied and published on its own): same outcomes, byte-exact,
/// also when stages mix new and already present blocks.
#[test]
fn staged_copies_keep_every_outcome() {
    let pool = PoolProcess::start(&unique_socket("xstage"), &["--capacity", "64MiB", "--min-object-size", "16KiB", "--copy-stage-size", "32KiB"]);
    let s = &pool.socket;
    let a = run_worker(s, 1, "per-layer", &["store", "--first-key", "0", "--count", "200"]);
    assert_eq!((n(&a, "stored"), n(&a, "failed")), (200, 0), "{a}");
    let b = run_worker(s, 1, "strided", &["store", "--first-key", "100", "--count", "200"]);
    assert_eq!((n(&b, "stored"), n(&b, "already_present"), n(&b, "failed")), (100, 100, 0), "{b}");
    let c = run_worker(s, 1, "cross", &["load", "--first-key", "250", "--count", "100"]);
    assert_eq!((n(&c, "loaded"), n(&c, "missing"), n(&c, "corrupt")), (50, 50, 0), "{c}");
    let report = pool.report();
    assert_eq!(report.pool.published_objects, 300, "{report}");
    let phases = &report.counters.phases;
    assert!(phases.store.stages > 2, "{phases}");
}

/// `--copy-stage-growth` sets how fast a submission's stages grow from the first: equal
/// stages (100) cut the same store into more stages than doubling (200), and `auto` for
/// these 4 KiB pages grows only a little (104 %), in between. Every outcome stays the same.
#[test]
fn copy_stage_growth_sets_how_fast_stages_grow() {
    let stages = |growth: &str| {
        let pool = PoolProcess::start(
            &unique_socket(&format!("xgrow{growth}")),
            &["--capacity", "64MiB", "--min-object-size", "16KiB", "--copy-stage-size", "1MiB", "--copy-stage-growth", growth],
        );
        let a = run_worker(&pool.socket, 1, "per-layer", &["store", "--first-key", "0", "--count", "256"]);
        assert_eq!((n(&a, "stored"), n(&a, "failed")), (256, 0), "growth {growth}: {a}");
        let b = run_worker(&pool.socket, 1, "strided", &["load", "--first-key", "0", "--count", "256"]);
        assert_eq!((n(&b, "loaded"), n(&b, "corrupt"), n(&b, "missing")), (256, 0, 0), "growth {growth}: {b}");
        pool.report().counters.phases.store.stages
    };
    let (equal, auto, doubling) = (stages("100"), stages("auto"), stages("200"));
    assert!(equal > auto && auto > doubling, "stages: 100 % {equal}, auto {auto}, 200 % {doubling}");
}
