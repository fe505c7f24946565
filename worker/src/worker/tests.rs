use super::*;

#[test]
fn worker_is_send() {
    fn send<T: Send>() {}
    send::<Worker>();
}

#[test]
fn config_validation() {
    let ok = WorkerConfig::new("/x", 1);
    assert!(ok.validate().is_ok());
    assert!(WorkerConfig { tp_rank: 2, tp_size: 2, ..ok.clone() }.validate().is_err());
    assert!(WorkerConfig { sq_entries: 100, ..ok.clone() }.validate().is_err());
    assert!(WorkerConfig { sq_entries: 256, ..ok.clone() }.validate().is_ok());
    assert!(WorkerConfig { arena_bytes: MAX_ARENA_BYTES + 1, ..ok.clone() }.validate().is_err());
    let h = WorkerConfig { tp_rank: 1, tp_size: 4, dp_rank: 3, sq_entries: 64, ..ok }.hello();
    assert_eq!((h.tp_rank, h.tp_size, h.dp_rank, h.sq_entries), (1, 4, 3, 64));
    assert_eq!(h.validate(), Ok(Role::Worker));
}

#[test]
fn unreachable_names_the_path() {
    let cfg = WorkerConfig { startup_timeout: Duration::from_millis(120), ..WorkerConfig::new("/nonexistent/umbp-test/pool.sock", 1) };
    let t = Instant::now();
    let err = Worker::connect(cfg).err().expect("no pool there");
    assert!(t.elapsed() >= Duration::from_millis(120), "retried until the startup timeout");
    assert!(matches!(err, WorkerError::Unreachable { .. }));
    assert!(err.to_string().contains("/nonexistent/umbp-test/pool.sock"), "{err}");
}

#[test]
fn completion_helpers() {
    let c = Completion {
        id: TransferId(1),
        statuses: vec![BlockStatus::Stored, BlockStatus::AlreadyPresent, BlockStatus::NotStored],
        error: None,
    };
    assert_eq!(c.ok_count(), 2);
    assert!(!c.all_ok());
    let f = Completion::failed(2, 3, Some(CqeError::Busy));
    assert_eq!(f.ok_count(), 0);
    assert_eq!(f.statuses, vec![BlockStatus::Failed; 3]);
}
