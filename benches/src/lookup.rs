//! `umbp-bench lookup`: what the engine's scheduler pays to find a cached prefix. The
//! shared-index `match_prefix` of a real pool (in this process) while another worker
//! streams stores into it, beside the same lookup done as a request/response over a unix
//! socket to a thread that owns the index (what an RPC design would cost). The shared-index
//! figure includes the client's liveness check (the index's `closed` word every call, a
//! socket poll at most once per `LIVENESS_INTERVAL`; docs/protocol.md "Pool liveness").

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use umbp_protocol::ObjectKey;
use umbp_scheduler::IndexClient;
use umbp_worker::{MemorySpec, Segment, Worker, WorkerConfig};

use super::report::{Better, Case};

pub struct LookupArgs {
    pub iterations: usize,
    pub blocks: Vec<usize>,
}

const PAGE: u64 = 16 << 10;
const SLOTS: u64 = 1024;

fn percentile(sorted: &[u64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize] as f64
}

/// A worker over `SLOTS` blocks of `PAGE` bytes of this process's memory.
fn worker(socket: &std::path::Path, ns: u128, mem: &mut Vec<u8>) -> Result<Worker, String> {
    *mem = vec![7u8; (SLOTS * PAGE) as usize];
    let mut w = Worker::connect(WorkerConfig::new(socket, ns)).map_err(|e| e.to_string())?;
    // SAFETY: the caller keeps `mem` (its own Vec) unchanged and alive while `w` lives.
    unsafe { w.register_memory(MemorySpec::HostProcess { ptr: mem.as_ptr() as usize, len: mem.len() }) }.map_err(|e| e.to_string())?;
    w.register_layout(0, vec![Segment::new(0, 0, PAGE, PAGE, SLOTS)]).map_err(|e| e.to_string())?;
    Ok(w)
}

fn store_all(w: &mut Worker, keys: &[ObjectKey]) -> Result<(), String> {
    for chunk in keys.chunks(SLOTS as usize) {
        let batch: Vec<_> = chunk.iter().enumerate().map(|(i, k)| (*k, i as u64)).collect();
        let id = w.store(0, &batch).map_err(|e| e.to_string())?;
        w.wait(id, Duration::from_secs(30)).ok_or("store did not complete")?;
    }
    Ok(())
}

pub fn run(args: &LookupArgs) -> std::io::Result<Vec<Case>> {
    measure(args).map_err(std::io::Error::other)
}

fn measure(args: &LookupArgs) -> Result<Vec<Case>, String> {
    let dir = tempfile::Builder::new().prefix("umbp-bench-lookup-").tempdir().map_err(|e| e.to_string())?;
    let socket = dir.path().join("pool.sock");
    let cfg = umbp_pool::PoolConfig { socket_path: socket.clone(), capacity_bytes: 1 << 30, min_object_bytes: PAGE, ..Default::default() };
    let pool = umbp_pool::Pool::start(cfg).map_err(|e| e.to_string())?;
    let ns = 0xbe7c_u128;
    let max_blocks = *args.blocks.iter().max().unwrap_or(&64);
    let keys: Vec<ObjectKey> = (0..max_blocks as u128).map(|i| ObjectKey::derive(ns, 0, 0, &i.to_le_bytes())).collect();
    let mut mem = Vec::new();
    let mut w = worker(&socket, ns, &mut mem)?;
    store_all(&mut w, &keys)?;

    // Concurrent store traffic from another worker for the whole measurement.
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = {
        let (stop, socket) = (stop.clone(), socket.clone());
        std::thread::spawn(move || -> u64 {
            let mut mem = Vec::new();
            let Ok(mut w) = worker(&socket, ns + 1, &mut mem) else { return 0 };
            let mut k = 0u128;
            let mut stored = 0;
            while !stop.load(Ordering::Relaxed) {
                let batch: Vec<_> = (0..64u64).map(|i| (ObjectKey::derive(ns + 1, 0, 0, &(k + i as u128).to_le_bytes()), i)).collect();
                k += 64;
                if let Ok(id) = w.store(0, &batch) {
                    if w.wait(id, Duration::from_secs(5)).is_some() {
                        stored += 64;
                    }
                }
            }
            stored
        })
    };

    // The RPC baseline: a thread owning an index client answers "how many of these keys
    // lead" over a unix socket.
    let (mut client, mut server) = UnixStream::pair().map_err(|e| e.to_string())?;
    let rpc = {
        let socket = socket.clone();
        std::thread::spawn(move || {
            let mut idx = IndexClient::connect(&socket, ns, Duration::from_secs(5)).expect("rpc index");
            let mut len = [0u8; 4];
            while server.read_exact(&mut len).is_ok() {
                let n = u32::from_le_bytes(len) as usize;
                let mut buf = vec![0u8; n * 16];
                if server.read_exact(&mut buf).is_err() {
                    return;
                }
                let keys: Vec<_> = buf.chunks_exact(16).map(|c| ObjectKey::from_bytes(c.try_into().unwrap())).collect();
                let hits = idx.match_prefix(&keys) as u32;
                if server.write_all(&hits.to_le_bytes()).is_err() {
                    return;
                }
            }
        })
    };

    let mut idx = IndexClient::connect(&socket, ns, Duration::from_secs(5)).map_err(|e| e.to_string())?;
    let mut cases = Vec::new();
    for &n in &args.blocks {
        let ks = &keys[..n];
        let mut shm = Vec::with_capacity(args.iterations);
        let mut sock = Vec::with_capacity(args.iterations);
        let mut wire = Vec::with_capacity(4 + n * 16);
        for it in 0..args.iterations + args.iterations / 10 {
            let t = Instant::now();
            let hits = idx.match_prefix(ks);
            let dt = t.elapsed().as_nanos() as u64;
            if hits != n {
                return Err(format!("match_prefix found {hits} of {n} stored keys"));
            }
            wire.clear();
            wire.extend_from_slice(&(n as u32).to_le_bytes());
            for k in ks {
                wire.extend_from_slice(&k.to_bytes());
            }
            let t = Instant::now();
            client.write_all(&wire).map_err(|e| e.to_string())?;
            let mut r = [0u8; 4];
            client.read_exact(&mut r).map_err(|e| e.to_string())?;
            let ds = t.elapsed().as_nanos() as u64;
            if u32::from_le_bytes(r) as usize != n {
                return Err("rpc baseline disagrees".into());
            }
            if it >= args.iterations / 10 {
                shm.push(dt);
                sock.push(ds);
            }
        }
        shm.sort_unstable();
        sock.sort_unstable();
        for (suffix, p) in [("", 0.5), ("_p99", 0.99)] {
            cases.push(
                Case::new(
                    "lookup",
                    &format!("match_prefix_{n}_blocks{suffix}"),
                    percentile(&shm, p),
                    "ns",
                    percentile(&sock, p),
                    "same lookup over a unix socket (request/response)",
                    Better::Lower,
                )
                .extra("iterations", args.iterations)
                .extra("concurrent_store_traffic", true)
                .extra("cpus", std::thread::available_parallelism().map(|c| c.get()).unwrap_or(1)),
            );
        }
    }
    stop.store(true, Ordering::Relaxed);
    let stored_meanwhile = traffic.join().unwrap_or(0);
    drop(client);
    let _ = rpc.join();
    for c in &mut cases {
        c.extra.insert("blocks_stored_meanwhile".into(), stored_meanwhile.into());
    }
    drop(pool);
    Ok(cases)
}
