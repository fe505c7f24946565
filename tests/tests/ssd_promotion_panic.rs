//! A copy thread that panics in the middle of a promotion from SSD (injected through the
//! in-process hook `umbp_pool::fault::panic_on_promotion_of`) must not leave the object
//! "promoting" forever: the promotion ends as failed (a miss), so the key can be stored
//! again and loads of it answer at once instead of waiting and missing for ever.
//! Real pool (in this process, with fault injection), real test-worker processes, real
//! segment files.

mod common;
use common::*;

use std::path::Path;
use std::time::{Duration, Instant};

/// 16 KiB objects: 4 layers x 4 KiB pages (the test worker's per-layer default).
const OBJECT: u64 = 16 << 10;
const DRAM: u64 = 8 << 20;

fn worker(socket: &Path, cmd: &[&str]) -> serde_json::Value {
    run_worker(socket, 1, "per-layer", cmd)
}

#[test]
fn a_panic_during_promotion_ends_it_as_failed() {
    let dir = tempfile::Builder::new().prefix("umbp-ssd-it-promo-panic-").tempdir_in("/var/tmp").expect("tempdir in /var/tmp");
    let socket = unique_socket("ssd-promo-panic");
    let ssd = small_ssd(dir.path());
    let pool = umbp_pool::Pool::start(umbp_pool::PoolConfig {
        socket_path: socket.clone(),
        capacity_bytes: DRAM,
        min_object_bytes: OBJECT,
        // One copy thread: a panic that killed it would hang everything after it.
        copy_threads: 1,
        ssd: Some(ssd),
        ..Default::default()
    })
    .expect("pool starts");

    // 4x DRAM: the older keys end up on SSD.
    let count = 4 * DRAM / OBJECT;
    store_all(&socket, 1, count, &[]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while pool.report().tiers.ssd < count / 2 {
        assert!(Instant::now() < deadline, "objects never reached SSD: {:?}", pool.report().tiers);
        std::thread::sleep(Duration::from_millis(50));
    }

    // The first key on SSD: its load promotes, and the fetch panics.
    let mut victim = None;
    for k in 0..64u128 {
        // The test worker derives its keys (namespace 1, no salt).
        umbp_pool::fault::panic_on_promotion_of(Some(umbp_worker::ObjectKey::derive(1, 0, 0, &k.to_le_bytes())));
        let ks = k.to_string();
        let l = worker(&socket, &["load", "--first-key", &ks, "--count", "1"]);
        umbp_pool::fault::panic_on_promotion_of(None);
        assert_eq!(n(&l, "corrupt"), 0, "{l}");
        if n(&l, "loaded") == 0 {
            victim = Some(k);
            break;
        }
    }
    let k = victim.expect("one of keys 0..64 was on SSD and its promotion panicked").to_string();

    // The pool (its single copy thread) keeps serving, and the key is not stuck.
    let t = Instant::now();
    let l = worker(&socket, &["load", "--first-key", &k, "--count", "1"]);
    assert_eq!((n(&l, "missing"), n(&l, "loaded")), (1, 0), "the failed promotion dropped the object: {l}");
    assert!(
        t.elapsed() < Duration::from_millis(1500),
        "a load of it answered at once, not after waiting for a promotion: {:?}",
        t.elapsed()
    );
    let s = worker(&socket, &["store", "--first-key", &k, "--count", "1"]);
    assert_eq!(n(&s, "stored") + n(&s, "not_stored"), 1, "the key can be stored again (not stuck in the index): {s}");
    if n(&s, "stored") == 1 {
        let l = worker(&socket, &["load", "--first-key", &k, "--count", "1"]);
        assert_eq!((n(&l, "loaded"), n(&l, "corrupt")), (1, 0), "{l}");
    }
    // Counted like any failed promotion.
    let failures = pool.report().ssd.unwrap().promotion_failures;
    assert!(failures >= 1, "the interrupted promotion counts as failed: {:?}", pool.report().ssd);
    // Every other key loads byte-exact (or is a miss): nothing wrong.
    let l = worker(&socket, &["load", "--first-key", "0", "--count", &count.to_string()]);
    assert_eq!((n(&l, "corrupt"), n(&l, "failed")), (0, 0), "{l}");
    assert!(n(&l, "loaded") >= count / 2, "{l}");
    pool.shutdown();
}
