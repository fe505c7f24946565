//! Scheduler behaviour against the in-process mock pool shared with umbp-worker's tests.

#[path = "../../worker/tests/common/mod.rs"]
mod common;

use std::time::Duration;

use common::{eventually, socket_path, MockPool, REFUSED_NAMESPACE};
use umbp_scheduler::*;

#[test]
fn prefix_lookups_and_hints() {
    let path = socket_path("sched-prefix");
    let pool = MockPool::start(&path);
    let mut idx = IndexClient::connect(&path, 7, Duration::from_secs(2)).unwrap();
    for k in [1, 2, 3, 5] {
        pool.insert_index(ObjectKey(k));
    }
    let keys: Vec<ObjectKey> = (1..=6).map(ObjectKey).collect();
    assert_eq!(idx.match_prefix(&keys), 3);
    assert!(idx.contains(ObjectKey(5)));
    assert!(!idx.contains(ObjectKey(4)));
    assert_eq!(idx.snapshot().unwrap().live, 4);
    idx.touch(&[ObjectKey(9)]);
    // Hints for the hits (1, 2, 3, then 5) and the explicit touch reach the pool.
    eventually(|| pool.hints().len() >= 5);
    assert_eq!(pool.hints(), [1, 2, 3, 5, 9].map(ObjectKey).to_vec());
}

#[test]
fn dead_pool_misses_and_restarted_pool_is_found() {
    let path = socket_path("sched-restart");
    let pool = MockPool::start(&path);
    let mut idx = IndexClient::connect(&path, 7, Duration::from_secs(2)).unwrap();
    pool.insert_index(ObjectKey(1));
    assert_eq!(idx.match_prefix(&[ObjectKey(1)]), 1);
    pool.kill();
    // The old mapping still says "present"; the liveness check turns that into a miss.
    eventually(|| !idx.is_attached());
    assert_eq!(idx.match_prefix(&[ObjectKey(1)]), 0);
    let pool = MockPool::start(&path);
    pool.insert_index(ObjectKey(2));
    eventually(|| idx.match_prefix(&[ObjectKey(2)]) == 1);
    assert!(!idx.contains(ObjectKey(1)), "the new pool's index, not the old one");
}

/// A pool that shut down marks its index closed before it releases anything: the very
/// next lookup misses, without waiting for the socket check (LIVENESS_INTERVAL), and the
/// client never reads that mapping again.
#[test]
fn closed_index_misses_at_once() {
    let path = socket_path("sched-closed");
    let pool = MockPool::start(&path);
    let mut idx = IndexClient::connect(&path, 7, Duration::from_secs(2)).unwrap();
    pool.insert_index(ObjectKey(1));
    assert_eq!(idx.match_prefix(&[ObjectKey(1)]), 1);
    pool.mark_index_closed();
    // The mock keeps the socket open: only the word can turn this into a miss.
    assert_eq!(idx.match_prefix(&[ObjectKey(1)]), 0, "a closed index must not hit");
    assert!(!idx.is_attached());
    assert_eq!(idx.match_prefix(&[ObjectKey(1)]), 0);
}

#[test]
fn lazy_client_attaches_when_the_pool_appears() {
    let path = socket_path("sched-lazy");
    let mut idx = IndexClient::lazy(&path, 7);
    assert_eq!(idx.match_prefix(&[ObjectKey(1)]), 0);
    let pool = MockPool::start(&path);
    pool.insert_index(ObjectKey(1));
    eventually(|| idx.match_prefix(&[ObjectKey(1)]) == 1);
    assert!(idx.is_attached());
}

#[test]
fn refusal_names_the_reason() {
    let path = socket_path("sched-refuse");
    let _pool = MockPool::start(&path);
    let err = IndexClient::connect(&path, REFUSED_NAMESPACE, Duration::from_secs(2)).err().unwrap();
    assert!(matches!(&err, SchedulerError::Refused { message, .. } if message.contains("0xBAD")), "{err}");
    // A lazy client with a refused namespace just misses.
    let mut idx = IndexClient::lazy(&path, REFUSED_NAMESPACE);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(idx.match_prefix(&[ObjectKey(1)]), 0);
}
