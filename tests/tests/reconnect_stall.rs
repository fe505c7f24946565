//! Regression (found by `umbp-bench soak`, docs/reliability.md): a pool that answers a
//! reconnecting worker's Hello and then answers each control message slowly (but within
//! `timeout_ms`) must not hold the engine thread that happens to drive the reconnect for up
//! to one timeout per replayed registration. The whole replay shares one timeout.
//!
//! A proxy between the worker and a real pool forwards every message (fds included) and
//! delays the replies to control messages on demand.

mod common;
use common::*;

use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use umbp_ipc::message::{recv_message, send_message, MessageError};
use umbp_protocol::wire::MessageKind;
use umbp_worker::{MemorySpec, Segment, Worker, WorkerConfig};

struct Proxy {
    /// Delay before each control-message reply, in ms.
    delay_ms: Arc<AtomicU64>,
    /// Bumping it drops every proxied connection (the worker sees its pool go away).
    generation: Arc<AtomicU64>,
}

fn forward(from: &UnixStream, to: &UnixStream) -> Result<MessageKind, MessageError> {
    let m = recv_message(from, Some(Duration::from_millis(20)))?;
    let fds: Vec<_> = m.fds.iter().map(|f| std::os::fd::AsFd::as_fd(f)).collect();
    send_message(to, m.kind, &m.payload, &fds, Some(Duration::from_secs(5)))?;
    Ok(m.kind)
}

fn serve(client: UnixStream, pool: &std::path::Path, delay: Arc<AtomicU64>, gen: Arc<AtomicU64>) {
    let born = gen.load(Ordering::SeqCst);
    let Ok(upstream) = UnixStream::connect(pool) else { return };
    while gen.load(Ordering::SeqCst) == born {
        match forward(&client, &upstream) {
            Ok(kind) => {
                if kind != MessageKind::Hello {
                    std::thread::sleep(Duration::from_millis(delay.load(Ordering::SeqCst)));
                }
                loop {
                    match forward(&upstream, &client) {
                        Ok(_) => break,
                        Err(MessageError::Timeout) => continue,
                        Err(_) => return,
                    }
                }
            }
            Err(MessageError::Timeout) => continue,
            Err(_) => return,
        }
    }
}

impl Proxy {
    fn start(listen: &std::path::Path, pool: &std::path::Path) -> Proxy {
        let listener = UnixListener::bind(listen).unwrap();
        let delay_ms = Arc::new(AtomicU64::new(0));
        let generation = Arc::new(AtomicU64::new(0));
        let (d, g, pool) = (delay_ms.clone(), generation.clone(), pool.to_path_buf());
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let (d, g, pool) = (d.clone(), g.clone(), pool.clone());
                std::thread::spawn(move || serve(client, &pool, d, g));
            }
        });
        Proxy { delay_ms, generation }
    }
}

#[test]
fn reregistration_with_a_slow_pool_blocks_at_most_one_timeout() {
    let timeout = Duration::from_millis(300);
    let pool = PoolProcess::start(&unique_socket("slowreg"), &["--capacity", "64MiB", "--min-object-size", "4KiB"]);
    let proxy_path = pool.socket.with_file_name("proxy.sock");
    let proxy = Proxy::start(&proxy_path, &pool.socket);
    let mut cfg = WorkerConfig::new(&proxy_path, 9);
    cfg.timeout = timeout;
    let mem = vec![0u8; 4 << 20];
    let mut w = Worker::connect(cfg).unwrap();
    // SAFETY: `mem` is declared before `w` and dropped after it (below); nothing reads it.
    unsafe { w.register_memory(MemorySpec::HostProcess { ptr: mem.as_ptr() as usize, len: mem.len() }) }.unwrap();
    // Three layouts: four control messages to replay after a reconnect.
    for g in 0..3u16 {
        w.register_layout(g, vec![Segment::new(0, g as u64 * (1 << 20), 4096, 4096, 256)]).unwrap();
    }
    // The connection drops; from now on each control reply takes 250 ms (< timeout).
    proxy.delay_ms.store(250, Ordering::SeqCst);
    proxy.generation.fetch_add(1, Ordering::SeqCst);
    assert!(eventually(Duration::from_secs(5), || {
        let _ = w.poll();
        !w.is_connected()
    }));
    // Each call drives the reconnect; none may block past the timeout (four replies of
    // 250 ms each would be a second).
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut worst = Duration::ZERO;
    while Instant::now() < deadline {
        let t = Instant::now();
        let _ = w.poll();
        worst = worst.max(t.elapsed());
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(worst < timeout + Duration::from_millis(150), "poll() blocked {worst:?} re-registering (timeout {timeout:?})");
    // A pool that answers in time again is re-attached to.
    proxy.delay_ms.store(0, Ordering::SeqCst);
    assert!(eventually(Duration::from_secs(10), || {
        let _ = w.poll();
        w.is_connected()
    }));
    let id = w.store(0, &[(umbp_worker::ObjectKey(1), 0)]).unwrap();
    assert!(w.wait(id, Duration::from_secs(5)).is_some_and(|c| c.all_ok()), "re-registered memory and layouts work");
    drop(w);
    drop(mem);
}
