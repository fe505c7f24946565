//! (d) The SSD tier's drive fills up while the pool runs (RLIMIT_FSIZE on the pool process:
//! writes past it fail with EFBIG, as on a full disk): demotions fail and those objects
//! become misses, never wrong bytes; the pool keeps serving from DRAM. Alone in its test
//! binary: it sets this process's file size limit around the pool's spawn.

mod common;
use common::*;

const OBJECT: u64 = 16 << 10;
const DRAM: u64 = 8 << 20;

fn set_fsize(bytes: u64) {
    let lim = libc::rlimit { rlim_cur: bytes, rlim_max: libc::RLIM_INFINITY };
    // SAFETY: setrlimit reads one rlimit.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_FSIZE, &lim) }, 0);
}

#[test]
fn disk_full_demotions_are_misses_and_dram_keeps_serving() {
    let dir = tempfile::Builder::new().prefix("umbp-ssd-it-full-").tempdir_in("/var/tmp").unwrap();
    let d = dir.path().to_str().unwrap();
    // The pool inherits a 10 MiB file size limit (its 8 MiB DRAM memfd fits): each 16 MiB
    // segment is refused past 10 MiB, as if the drive filled up.
    set_fsize(10 << 20);
    let pool = PoolProcess::start(
        &unique_socket("ssd-full"),
        &[
            "--capacity", "8MiB", "--min-object-size", "16KiB", "--ssd-dir", d, "--ssd-capacity", "256MiB", "--ssd-segment-size", "16MiB",
            "--ssd-admission", "all",
        ],
    );
    set_fsize(libc::RLIM_INFINITY);
    let count = 6 * DRAM / OBJECT;
    let c = count.to_string();
    // Store the same keys again until the drive is full: on a loaded machine the evictor
    // drops objects it had no time to demote, and a later round stores them again, so the
    // demoted bytes grow each round. At least 3 rounds; the limit only ends a broken run.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut rounds = 0;
    let ssd = loop {
        let r = run_worker(&pool.socket, 1, "per-layer", &["store", "--first-key", "0", "--count", &c]);
        assert_eq!(n(&r, "failed"), 0, "{r}");
        std::thread::sleep(std::time::Duration::from_millis(200));
        rounds += 1;
        let ssd = pool.report().ssd.unwrap();
        if rounds >= 3 && (ssd.demotion_failures > 0 || std::time::Instant::now() > deadline) {
            break ssd;
        }
    };
    assert!(ssd.demotion_failures > 0, "the full drive refused demotions: {ssd:?}");
    assert!(ssd.demotions > 0, "those before it filled went to SSD: {ssd:?}");
    let l = run_worker(&pool.socket, 1, "per-layer", &["load", "--first-key", "0", "--count", &c]);
    assert_eq!(n(&l, "corrupt"), 0, "{l}");
    assert_eq!(n(&l, "failed"), 0, "{l}");
    assert!(n(&l, "missing") > 0, "objects whose demotion failed are misses: {l}");
    assert!(n(&l, "loaded") > 0, "{l}");
    // DRAM keeps serving: fresh stores load back. First the load's promotions are all
    // released and the evictor is done (a store that finds DRAM full this instant is
    // `not_stored`, by design): 32 objects then fit below the high watermark.
    wait_until("the load's objects unpinned and DRAM below its high watermark", std::time::Duration::from_secs(10), || {
        let p = pool.report().pool;
        p.pinned_objects == 0 && (p.allocated_bytes as f64) <= p.high_watermark * p.capacity_bytes as f64
    });
    let r = run_worker(&pool.socket, 1, "per-layer", &["store", "--first-key", "100000", "--count", "32"]);
    assert_eq!(n(&r, "stored"), 32, "{r}");
    let l = run_worker(&pool.socket, 1, "per-layer", &["load", "--first-key", "100000", "--count", "32"]);
    assert_eq!((n(&l, "loaded"), n(&l, "corrupt")), (32, 0), "{l}");
}
