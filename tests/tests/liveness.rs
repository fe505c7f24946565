//! Scheduler liveness (docs/protocol.md, "Pool liveness"): lookups read the index without
//! a syscall on most calls, yet a SIGKILLed pool's stale mapping answers no hit to a lookup
//! that starts after the pool was reaped (the kernel marked the index's death word by then;
//! the socket poll, at most `LIVENESS_INTERVAL` apart, is the fallback), and never hits
//! again once the client noticed.

use std::time::{Duration, Instant};

use umbp_integration_tests::{unique_socket, worker_on_memfd, PoolProcess};
use umbp_scheduler::IndexClient;
use umbp_worker::{ObjectKey, WorkerConfig};

const PAGE: u64 = 16 << 10;
const BLOCKS: u64 = 16;

#[test]
fn killed_pool_lookups_miss_once_it_is_reaped() {
    let mut pool = PoolProcess::start(&unique_socket("liveness"), &["--capacity", "64MiB", "--min-object-size", "16KiB"]);
    let (mut w, _kv) = worker_on_memfd(WorkerConfig::new(&pool.socket, 7), PAGE, BLOCKS);
    let keys: Vec<ObjectKey> = (0..BLOCKS as u128).map(|i| ObjectKey(0x11fe_0000 + i)).collect();
    let batch: Vec<_> = keys.iter().enumerate().map(|(i, k)| (*k, i as u64)).collect();
    let id = w.store(0, &batch).unwrap();
    assert!(w.wait(id, Duration::from_secs(10)).expect("store completes").all_ok());

    let mut idx = IndexClient::connect(&pool.socket, 7, Duration::from_secs(5)).unwrap();
    assert_eq!(idx.match_prefix(&keys), keys.len());
    // SIGKILL (and reap: the kernel has closed the pool's sockets when `kill` returns) from
    // another thread while this one looks up as fast as it can, so that the client's last
    // socket poll is recent when the pool dies.
    let killed = std::sync::Arc::new(std::sync::OnceLock::new());
    let killer = {
        let killed = killed.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            pool.kill();
            killed.set(Instant::now()).unwrap();
        })
    };
    let mut calls: Vec<(Instant, usize)> = Vec::with_capacity(1 << 20);
    loop {
        let start = Instant::now();
        calls.push((start, idx.match_prefix(&keys)));
        if killed.get().is_some_and(|k| start.saturating_duration_since(*k) > Duration::from_millis(50)) || calls.len() == calls.capacity()
        {
            break;
        }
    }
    killer.join().unwrap();
    let killed = *killed.get().expect("the pool was killed during the lookups");
    let mut noticed = None;
    for (i, &(start, n)) in calls.iter().enumerate() {
        if n == 0 {
            noticed.get_or_insert(i);
            continue;
        }
        assert_eq!(n, keys.len());
        assert!(noticed.is_none(), "a hit after the client had noticed the pool was gone");
        if start >= killed {
            // The death word was marked before `kill` (SIGKILL + waitpid) returned.
            panic!("a lookup that started {:?} after the pool was reaped hit", start - killed);
        }
    }
    let noticed = noticed.expect("lookups never missed after the kill");
    // (A time bound on the first miss would measure the scheduler of this loaded machine:
    // this thread may not run for milliseconds after the kill. What holds is above: every
    // lookup that started after the pool was reaped missed.)
    assert!(calls.last().unwrap().0 > killed, "no lookup after the kill");
    assert!(!idx.is_attached());
    println!(
        "{} lookups, none hit after the kill returned; first miss {:?} after it",
        calls.len(),
        calls[noticed].0.saturating_duration_since(killed)
    );
}
