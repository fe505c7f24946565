//! The cluster port before authentication (issue #32 item 3; docs/security.md, "Cluster"):
//! a real pool process with a cluster port and an ordinary RLIMIT_NOFILE of 1024, flooded
//! with 500 connections that each send one byte every 1.5 s (within any per-read timeout,
//! never finishing a handshake). The pool's local side must not notice: an attachment (a
//! scheduler's index client) and `ringtool dump` each succeed within 1 s, and every
//! trickling connection is closed within the total handshake deadline (2 s) plus slack.
//! Before: the 2 s deadline was per read (a trickle lived forever), every connection got a
//! thread and two fds, and the local side ran out of file descriptors.

mod common;
use common::*;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

const TRICKLERS: usize = 500;

#[test]
fn five_hundred_trickling_connections_neither_starve_the_local_side_nor_outlive_the_deadline() {
    if !cluster::nixl_on_loopback() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let secret = cluster::secret_file(dir.path(), b"cluster-port-dos-secret-0123456789");
    let me = cluster::loopback_addr();
    let timing = cluster::Timing { heartbeat_ms: 200, dead_after_ms: 1000, read_timeout_ms: 3000 };
    let args = cluster::pool_args(&me, &[], &secret, timing, &[]);
    let pool = PoolProcess::start(&unique_socket("cludos"), &args.iter().map(String::as_str).collect::<Vec<_>>());
    // An ordinary soft limit (many distributions' default), whatever this machine's is.
    let lim = libc::rlimit { rlim_cur: 1024, rlim_max: 1024 };
    // SAFETY: prlimit on our own child with a valid struct; the old value is not asked for.
    let rc = unsafe { libc::prlimit(pool.pid(), libc::RLIMIT_NOFILE, &lim, std::ptr::null_mut()) };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());

    // The cluster port comes up after the local socket.
    wait_until("the cluster port to listen", Duration::from_secs(20), || TcpStream::connect(&me).is_ok());
    // 500 connections, each sending the start of a valid preface, one byte every 1.5 s.
    let preface = b"UMBP\x03\x00\x00\x00\x00\x30";
    let t0 = Instant::now();
    let mut conns: Vec<(TcpStream, Option<Duration>)> = Vec::new();
    for _ in 0..TRICKLERS {
        if let Ok(s) = TcpStream::connect_timeout(&me.parse().unwrap(), Duration::from_secs(1)) {
            s.set_nonblocking(true).unwrap();
            conns.push((s, None));
        }
    }
    println!("{} of {TRICKLERS} connections opened in {:?}", conns.len(), t0.elapsed());
    assert!(conns.len() >= TRICKLERS * 9 / 10, "the flood could not even connect: {} of {TRICKLERS}", conns.len());
    let flood_start = Instant::now();
    // Trickle for 6 s (4 bytes each, every 1.5 s), noting when the pool closed each one.
    let mut checked_local = false;
    let mut sent = 0usize;
    while flood_start.elapsed() < Duration::from_secs(6) {
        let byte = [preface[sent % preface.len()]];
        for (s, closed) in conns.iter_mut().filter(|(_, c)| c.is_none()) {
            let mut b = [0u8; 16];
            // EOF, a reset, or a failed write: the pool closed it (it never sends a byte here).
            let gone = match s.read(&mut b) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => s.write(&byte).is_err(),
                _ => true,
            };
            if gone {
                *closed = Some(flood_start.elapsed());
            }
        }
        sent += 1;
        if !checked_local {
            checked_local = true;
            // The pool's local side under the flood: an attachment and ringtool, 1 s each.
            let t = Instant::now();
            let idx = umbp_scheduler::IndexClient::connect(&pool.socket, 1, Duration::from_secs(1));
            let took = t.elapsed();
            assert!(idx.is_ok() && took < Duration::from_secs(1), "local attach under the flood: {:?} after {took:?}", idx.err());
            let t = Instant::now();
            let out = Command::new(workspace_binary("ringtool")).args(["dump", "--socket"]).arg(&pool.socket).output().unwrap();
            let took = t.elapsed();
            assert!(
                out.status.success() && took < Duration::from_secs(1),
                "ringtool dump under the flood took {took:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            println!("under the flood: attach and ringtool dump answered (dump in {took:?})");
        }
        std::thread::sleep(Duration::from_millis(1500));
    }
    let open: Vec<usize> = conns.iter().enumerate().filter(|(_, (_, c))| c.is_none()).map(|(i, _)| i).collect();
    let last = conns.iter().filter_map(|(_, c)| *c).max();
    println!("every trickler closed by the pool; the last {last:?} into the flood; {} fds open in the pool", pool.open_fds());
    assert!(open.is_empty(), "{} trickling connections still open 6 s into the flood (deadline 2 s)", open.len());
    // Closed at accept (over the caps) or at the 2 s deadline, seen at the next 1.5 s tick.
    assert!(last.is_some_and(|l| l <= Duration::from_millis(5000)), "a trickler lived {last:?}");
}
