//! The relay attack on the cluster control channel (issue #32 item 1; docs/security.md,
//! "Cluster"): pool B lists an address that a test-owned relay holds (as an attacker who
//! can bind an address in a member's `--cluster-peer` list could), and the relay forwards
//! bytes both ways to pool A. Pools A and B are real processes, the relay is a real TCP
//! forwarder that records everything it sees. The relay learns nothing: no `Join` (NIXL
//! metadata, DRAM base), no key, no field name crosses it in the clear, although B lists
//! and loads A's blocks through it; and a frame it injects closes the connection instead of
//! being acted on. Before, the HMAC handshake authenticated the two ends but nothing after
//! it: the relay read A's `Join` and catalog in plaintext and could inject pins.

mod common;
use common::*;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use umbp_protocol::ObjectKey;

/// One relayed connection: the socket to A (writes under the lock, so an injection does
/// not split a forwarded chunk) and whether A closed it.
struct Relayed {
    to_a: Arc<Mutex<TcpStream>>,
    a_closed: Arc<AtomicBool>,
}

/// Accepts on `l`, dials `a` for each connection and forwards both ways, appending what A
/// sends to `seen_from_a` and what B sends to `seen_from_b`.
fn relay(l: TcpListener, a: String, seen_from_a: Arc<Mutex<Vec<u8>>>, seen_from_b: Arc<Mutex<Vec<u8>>>, conns: Arc<Mutex<Vec<Relayed>>>) {
    for b in l.incoming() {
        let Ok(b) = b else { continue };
        let Ok(a_sock) = TcpStream::connect(&a) else { continue };
        let to_a = Arc::new(Mutex::new(a_sock.try_clone().unwrap()));
        let a_closed = Arc::new(AtomicBool::new(false));
        conns.lock().unwrap().push(Relayed { to_a: to_a.clone(), a_closed: a_closed.clone() });
        let (mut a_rd, mut b_wr, seen) = (a_sock, b.try_clone().unwrap(), seen_from_a.clone());
        let closed = a_closed.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 1 << 16];
            while let Ok(n) = a_rd.read(&mut buf) {
                if n == 0 {
                    break;
                }
                seen.lock().unwrap().extend_from_slice(&buf[..n]);
                if b_wr.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            closed.store(true, Ordering::Release);
            let _ = b_wr.shutdown(std::net::Shutdown::Both);
        });
        let (mut b_rd, seen) = (b, seen_from_b.clone());
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 1 << 16];
            while let Ok(n) = b_rd.read(&mut buf) {
                if n == 0 {
                    break;
                }
                seen.lock().unwrap().extend_from_slice(&buf[..n]);
                if to_a.lock().unwrap().write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            let _ = to_a.lock().unwrap().shutdown(std::net::Shutdown::Both);
        });
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn a_relay_between_two_members_reads_nothing_and_cannot_inject() {
    if !cluster::nixl_on_loopback() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let secret = cluster::secret_file(dir.path(), b"cluster-relay-secret-0123456789abcdef");
    let (a_addr, b_addr) = (cluster::loopback_addr(), cluster::loopback_addr());
    let relay_l = TcpListener::bind("127.0.0.1:0").unwrap();
    let relay_addr = relay_l.local_addr().unwrap().to_string();
    let (from_a, from_b) = (Arc::new(Mutex::new(Vec::new())), Arc::new(Mutex::new(Vec::new())));
    let conns = Arc::new(Mutex::new(Vec::new()));
    {
        let (a, fa, fb, c) = (a_addr.clone(), from_a.clone(), from_b.clone(), conns.clone());
        std::thread::spawn(move || relay(relay_l, a, fa, fb, c));
    }
    let timing = cluster::Timing { heartbeat_ms: 200, dead_after_ms: 1500, read_timeout_ms: 3000 };
    let a_args = cluster::pool_args(&a_addr, &[], &secret, timing, &[]);
    let b_args = cluster::pool_args(&b_addr, &[&relay_addr], &secret, timing, &[]);
    let pool_a = PoolProcess::start(&unique_socket("relay-a"), &a_args.iter().map(String::as_str).collect::<Vec<_>>());
    let pool_b = PoolProcess::start(&unique_socket("relay-b"), &b_args.iter().map(String::as_str).collect::<Vec<_>>());

    let r = run_worker(&pool_a.socket, 1, "per-layer", &["store", "--first-key", "0", "--count", "40"]);
    assert_eq!((n(&r, "stored"), n(&r, "failed")), (40, 0), "{r}");
    // B subscribes to A through the relay: the honest ends work as before ...
    wait_until("pool B to list pool A's blocks through the relay", Duration::from_secs(20), || pool_b.report().tiers.remote == 40);
    let l = run_worker(&pool_b.socket, 1, "per-layer", &["load", "--first-key", "0", "--count", "10"]);
    assert_eq!((n(&l, "loaded"), n(&l, "corrupt")), (10, 0), "pins and reads through the relay: {l}");

    // ... and the relay saw only ciphertext.
    let seen_a = from_a.lock().unwrap().clone();
    let seen_b = from_b.lock().unwrap().clone();
    assert!(seen_a.len() > 1000 && !seen_b.is_empty(), "the relay carried the connection ({} / {} bytes)", seen_a.len(), seen_b.len());
    let key0 = format!("{:032x}", ObjectKey::derive(1, 0, 0, &0u128.to_le_bytes()).0);
    for (what, needle) in [
        ("a Join", &b"Join"[..]),
        ("NIXL metadata", b"metadata"),
        ("a key list", b"Keys"),
        ("a pin answer", b"Pinned"),
        ("a JSON tag", b"\"t\""),
        ("a stored key", key0.as_bytes()),
    ] {
        assert!(!contains(&seen_a, needle), "{what} crossed the relay in the clear from A");
        assert!(!contains(&seen_b, needle), "{what} crossed the relay in the clear from B");
    }

    // The relay injects a frame into B's side of the stream (a pin, in the old protocol's
    // plaintext framing): A closes the connection instead of answering it.
    let pin = br#"{"t":"Pin","id":999,"group":0,"namespace":"00000000000000000000000000000001","key":"00000000000000000000000000000000","size":1}"#;
    let mut frame = (pin.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(pin);
    let (to_a, a_closed) = {
        let c = conns.lock().unwrap();
        let last = c.last().expect("a relayed connection");
        (last.to_a.clone(), last.a_closed.clone())
    };
    assert!(!a_closed.load(Ordering::Acquire), "the relayed connection is up before the injection");
    let before = from_a.lock().unwrap().len();
    to_a.lock().unwrap().write_all(&frame).unwrap();
    let t = Instant::now();
    while !a_closed.load(Ordering::Acquire) {
        assert!(t.elapsed() < Duration::from_secs(3), "A kept the connection after an injected frame");
        std::thread::sleep(Duration::from_millis(10));
    }
    println!("A closed the relayed connection {:?} after the injected frame", t.elapsed());
    let after = from_a.lock().unwrap()[before..].to_vec();
    assert!(!contains(&after, b"Pinned") && !contains(&after, b"999"), "A answered the injected pin");
}
