//! Attack suite (issue #13, docs/security.md): each test plays a hostile peer against real
//! processes over real sockets and fails on the code before the defence. Tests that need
//! root (a second uid, a setuid program, huge pages, a pid namespace) print "skipped: ..."
//! when they cannot get it.
//!
//! Items 1, 3, 4, 13 here; item 2 (GPU IPC mappings per peer) is a unit test in
//! gpu/src/engine/ipc_cache.rs (`ipc_mappings_are_not_shared_between_peers`): there is no GPU on the
//! machines that run this suite.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use umbp_worker::{BlockStatus, MemorySpec, ObjectKey, Segment, Worker, WorkerConfig};

const NOBODY: u32 = 65534;
/// Where the attacker and the victim both map their page (fixed: the attacker must know
/// the victim's address; a real one would aim at something predictable).
const FIXED_ADDR: u64 = 0x5a5a_0000_0000;

/// A fresh directory (root, 0755) for copies of binaries and sockets.
fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("umbp-attack-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
    d
}

/// Copies of umbp-attacker in `dir`: a plain one and a setuid-root one (the victim).
fn install_attacker(dir: &Path) -> (PathBuf, PathBuf) {
    let src = workspace_binary("umbp-attacker");
    let plain = dir.join("attacker");
    let setuid = dir.join("victim");
    std::fs::copy(&src, &plain).unwrap();
    std::fs::copy(&src, &setuid).unwrap();
    std::fs::set_permissions(&plain, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&setuid, std::fs::Permissions::from_mode(0o4755)).unwrap();
    (plain, setuid)
}

/// Runs `cmd` as uid/gid 65534 with stdout piped; returns the child and a line reader.
fn spawn_as_nobody(cmd: &mut Command) -> (Child, std::sync::mpsc::Receiver<String>) {
    let mut child = cmd.uid(NOBODY).gid(NOBODY).stdout(Stdio::piped()).stdin(Stdio::null()).spawn().expect("spawn as nobody");
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

fn next_line(rx: &std::sync::mpsc::Receiver<String>, what: &str) -> String {
    rx.recv_timeout(Duration::from_secs(30)).unwrap_or_else(|_| panic!("no {what} within 30 s"))
}

/// Item 1: the attacker connects, forks, and the process the pool knows by SO_PEERCRED
/// executes a setuid-root program holding a secret. Returns the attacker's JSON report, or
/// None when the setup is impossible here (printed). `fallback`: the pool takes pidfds with
/// `pidfd_open` + start time (`--peer-pidfd-fallback`, the path of kernels without
/// SO_PEERPIDFD); the pool's report must then show that it did.
fn exec_swap(tag: &str, before: bool, fallback: bool) -> Option<serde_json::Value> {
    if !root_or_skip("a second uid and a setuid-root victim") {
        return None;
    }
    let dir = scratch(tag);
    let (attacker, victim) = install_attacker(&dir);
    // A root pool (CAP_SYS_PTRACE: the kernel's own ptrace check lets it into anything).
    let mut args = vec!["--capacity", "64MiB", "--min-object-size", "4KiB", "--allow-uid", "65534", "--socket-group", "65534"];
    if fallback {
        args.push("--peer-pidfd-fallback");
    }
    let pool = PoolProcess::start(&dir.join("sock").join("pool.sock"), &args);
    let mut cmd = Command::new(&attacker);
    cmd.arg("exec-swap").arg("--socket").arg(&pool.socket).arg("--victim").arg(&victim).args(["--addr", &FIXED_ADDR.to_string()]);
    if before {
        cmd.arg("--before");
    }
    let (mut child, rx) = spawn_as_nobody(&mut cmd);
    let line = next_line(&rx, "attacker report");
    let _ = child.kill();
    let _ = child.wait();
    let fallbacks = pool.report().counters.pidfd_open_peers;
    // Without the flag this kernel's SO_PEERPIDFD is used (where it has one: 6.5+).
    assert!(if fallback { fallbacks >= 1 } else { fallbacks == 0 || !so_peerpidfd_here() }, "pidfd_open_peers {fallbacks}");
    let _ = std::fs::remove_dir_all(&dir);
    let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad report {line:?}: {e}"));
    println!("{v}");
    assert!(v.get("error").is_none(), "attacker could not attach: {v}");
    if !v["victim"].as_str().unwrap_or("").contains("euid=0") {
        umbp_integration_tests::root::skip_root_part(&format!("the setuid victim did not run as root here ({v}); nosuid temp directory?"));
        return None;
    }
    Some(v)
}

/// A setuid program exec'd after connect: its memory is never registered, the refusal
/// says why, nothing leaks. `path` names the peer-identity path in failure messages.
fn assert_swap_after_connect_refused(v: &serde_json::Value, path: &str) {
    let register = v["register"].as_str().unwrap();
    assert_ne!(register, "ok", "{path}: the pool registered memory of a setuid program that replaced the peer: {v}");
    assert!(register.contains("setuid") || register.contains("uid"), "{path}: refusal should say why: {register}");
    assert_eq!(v["leaked"], serde_json::Value::Null, "{path}: {v}");
}

/// A setuid program exec'd after registration: its secret is never copied, its stores fail.
fn assert_swap_after_registration_unread(v: &serde_json::Value, path: &str) {
    assert_eq!(v["register"], "ok", "{path}: registered while still the attacker's own process: {v}");
    assert_eq!(v["leaked"], false, "{path}: the pool copied the setuid program's secret to the attacker: {v}");
    assert!(!v["store"].as_str().unwrap_or("").contains("Stored"), "{path}: store from the swapped process must fail: {v}");
}

#[test]
fn exec_of_a_setuid_program_after_connect_cannot_be_registered() {
    let Some(v) = exec_swap("swap-after", false, false) else { return };
    assert_swap_after_connect_refused(&v, "default path");
}

#[test]
fn exec_of_a_setuid_program_after_registration_cannot_be_read() {
    let Some(v) = exec_swap("swap-before", true, false) else { return };
    assert_swap_after_registration_unread(&v, "default path");
}

/// The same two attacks against the fallback path of kernels without SO_PEERPIDFD:
/// `pidfd_open` of the SO_PEERCRED pid at accept plus its start time, forced with
/// `--peer-pidfd-fallback`. Before, nothing ran this path.
#[test]
fn exec_of_a_setuid_program_is_caught_on_the_pidfd_open_fallback_too() {
    let Some(v) = exec_swap("swap-after-fb", false, true) else { return };
    assert_swap_after_connect_refused(&v, "fallback path");
    let Some(v) = exec_swap("swap-before-fb", true, true) else { return };
    assert_swap_after_registration_unread(&v, "fallback path");
}

/// Item 1, pid reuse: a process of uid 65534 connects and says Hello, hands its
/// connection on (here: the fd is shared with its parent) and exits; its pid is then given
/// to another process of the same uid (forced with `ns_last_pid`), and the connection asks
/// the pool to register that process's memory. A pool that trusted the SO_PEERCRED pid
/// (plus a uid check, which passes: same uid) would read and write the new process; the
/// pidfd and start time taken at accept still name the exited one, so the registration is
/// refused ("pid N now names another process (start time changed)"). Run on both paths:
/// SO_PEERPIDFD and the pidfd_open fallback.
fn pid_reuse(tag: &str, fallback: bool) -> Option<(u32, String)> {
    use umbp_ipc::message::{recv_message, send_message};
    use umbp_protocol::wire::{Hello, MemoryKind, MemoryRegistration, MessageHeader, MessageKind, Reply, Role};
    if !root_or_skip("a second uid and ns_last_pid") {
        return None;
    }
    let dir = scratch(tag);
    let mut args = vec!["--capacity", "64MiB", "--min-object-size", "4KiB", "--allow-uid", "65534"];
    if fallback {
        args.push("--peer-pidfd-fallback");
    }
    let pool = PoolProcess::start(&dir.join("sock").join("pool.sock"), &args);
    std::fs::set_permissions(&pool.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    // Everything the child needs is prepared before fork: it only makes raw syscalls.
    let mut hello = bytemuck::bytes_of(&MessageHeader::new(MessageKind::Hello, std::mem::size_of::<Hello>(), 0)).to_vec();
    hello.extend_from_slice(bytemuck::bytes_of(&Hello::new(Role::Worker, 7, 0)));
    // SAFETY: all-zero is a valid sockaddr_un.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let path = std::os::unix::ffi::OsStrExt::as_bytes(pool.socket.as_os_str());
    assert!(path.len() < addr.sun_path.len(), "socket path too long");
    for (d, s) in addr.sun_path.iter_mut().zip(path) {
        *d = *s as libc::c_char;
    }
    // SAFETY: a plain socket(2).
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0);
    let reply_len = std::mem::size_of::<MessageHeader>() + std::mem::size_of::<umbp_protocol::wire::HelloReply>();
    // SAFETY: the child runs only async-signal-safe syscalls on memory prepared above, then
    // _exit; the parent's threads are not touched.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: (child) raw syscalls only.
        unsafe {
            if libc::syscall(libc::SYS_setresuid, 65534 as libc::c_long, 65534 as libc::c_long, 65534 as libc::c_long) != 0
                || libc::connect(
                    fd,
                    (&addr as *const libc::sockaddr_un).cast(),
                    std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
                ) != 0
                || libc::write(fd, hello.as_ptr().cast(), hello.len()) != hello.len() as isize
            {
                libc::_exit(2);
            }
            // Wait for the HelloReply: the pool has accepted and attached this process.
            let mut buf = [0u8; 512];
            let mut got = 0usize;
            while got < reply_len {
                let n = libc::read(fd, buf.as_mut_ptr().add(got).cast(), reply_len - got);
                if n <= 0 {
                    libc::_exit(3);
                }
                got += n as usize;
            }
            libc::_exit(0);
        }
    }
    let mut status = 0;
    // SAFETY: waits for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the connecting child failed: {status:#x}");
    // SAFETY: `fd` is ours (the child's copy is closed with it).
    let sock = std::os::unix::net::UnixStream::from(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) });
    // Give the exited child's pid to a new process of the same uid.
    let victim = (0..20).find_map(|_| {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).ok()?;
        let mut c = Command::new("sleep").arg("60").uid(NOBODY).gid(NOBODY).spawn().ok()?;
        if c.id() == pid as u32 {
            return Some(c);
        }
        let _ = c.kill();
        let _ = c.wait();
        None
    });
    let Some(mut victim) = victim else {
        println!("skipped: could not hand pid {pid} to a new process (ns_last_pid; another process took it)");
        return None;
    };
    std::thread::sleep(Duration::from_millis(50));
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let start = u64::from_str_radix(maps.lines().next().unwrap().split('-').next().unwrap(), 16).unwrap();
    let mut reg: MemoryRegistration = bytemuck::Zeroable::zeroed();
    reg.kind = MemoryKind::HostProcess as u32;
    reg.alloc_id = 1;
    reg.address = start;
    reg.size = 4096;
    let t = Some(Duration::from_secs(5));
    send_message(&sock, MessageKind::RegisterMemory, bytemuck::bytes_of(&reg), &[], t).unwrap();
    let m = recv_message(&sock, t).unwrap();
    let reply: Reply = umbp_protocol::wire::decode(&m.payload).unwrap();
    let fallbacks = pool.report().counters.pidfd_open_peers;
    let _ = victim.kill();
    let _ = victim.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(if fallback { fallbacks >= 1 } else { fallbacks == 0 || !so_peerpidfd_here() }, "pidfd_open_peers {fallbacks}");
    Some((reply.status, reply.message().to_string()))
}

#[test]
fn a_reused_pid_cannot_be_registered() {
    for (tag, fallback) in [("reuse", false), ("reuse-fb", true)] {
        let Some((status, message)) = pid_reuse(tag, fallback) else { return };
        println!("pid reuse (fallback {fallback}): status {status}, {message}");
        assert_ne!(status, 0, "fallback {fallback}: the pool registered memory of the process that took the peer's pid");
        assert!(
            message.contains("exited") || message.contains("another process"),
            "fallback {fallback}: the refusal should say the peer's process is gone: {message}"
        );
    }
}

/// Whether this kernel answers SO_PEERPIDFD (Linux 6.5+) on a socketpair.
fn so_peerpidfd_here() -> bool {
    let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `fd`.
    let rc = unsafe {
        libc::getsockopt(std::os::fd::AsRawFd::as_raw_fd(&a), libc::SOL_SOCKET, 77, (&mut fd as *mut libc::c_int).cast(), &mut len)
    };
    if rc == 0 && fd >= 0 {
        // SAFETY: the kernel gave us this fd.
        unsafe { libc::close(fd) };
    }
    rc == 0
}

// ---------------------------------------------------------------------------------------
// Item 3: a hugetlb memfd sealed only against shrinking loses its pages to a hole punch.

/// Restores /proc/sys/vm/nr_hugepages on drop.
struct HugePages(Option<u64>);

const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

fn meminfo(field: &str) -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(field).map(|v| v.trim().trim_end_matches(" kB").trim().parse().unwrap()))
        .unwrap_or(0)
}

impl HugePages {
    /// Leaves exactly one free 2 MiB huge page, or says why not.
    fn exactly_one_free() -> Result<Self, String> {
        let old: u64 = std::fs::read_to_string(NR_HUGEPAGES).map_err(|e| e.to_string())?.trim().parse().unwrap();
        let in_use = meminfo("HugePages_Total:") - meminfo("HugePages_Free:");
        if meminfo("Hugepagesize:") != 2048 {
            return Err("default huge page size is not 2 MiB".into());
        }
        std::fs::write(NR_HUGEPAGES, format!("{}", in_use + 1)).map_err(|e| format!("cannot write {NR_HUGEPAGES}: {e}"))?;
        let guard = Self(Some(old));
        if meminfo("HugePages_Free:") != 1 {
            return Err(format!("could not leave exactly one free huge page ({} free)", meminfo("HugePages_Free:")));
        }
        Ok(guard)
    }
}

impl Drop for HugePages {
    fn drop(&mut self) {
        if let Some(old) = self.0 {
            let _ = std::fs::write(NR_HUGEPAGES, old.to_string());
        }
    }
}

/// Maps `len` bytes of `fd` shared and writes `byte` over them; returns the mapping.
fn map_and_fill(fd: &std::fs::File, len: usize, byte: u8) -> *mut u8 {
    // SAFETY: a fresh shared mapping of a file at least `len` long; for hugetlb the mmap
    // reserves the pages, so the writes below cannot fault with SIGBUS.
    unsafe {
        let p = libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0);
        assert_ne!(p, libc::MAP_FAILED, "mmap: {}", std::io::Error::last_os_error());
        std::ptr::write_bytes(p.cast::<u8>(), byte, len);
        p.cast()
    }
}

fn punch_hole(fd: &std::fs::File, len: u64) {
    // SAFETY: plain syscall on an fd we own.
    let rc = unsafe { libc::fallocate(fd.as_raw_fd(), libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, 0, len as i64) };
    assert_eq!(rc, 0, "punch hole: {}", std::io::Error::last_os_error());
}

/// Registers `fd` through a raw socket, bypassing the worker library's own checks, and
/// returns the pool's reply status and message.
fn raw_register_memfd(socket: &Path, fd: &std::fs::File, len: u64) -> (u32, String) {
    use umbp_ipc::message::{recv_message, send_message};
    use umbp_protocol::wire::{self, Hello, HelloReply, MemoryKind, MemoryRegistration, MessageKind, Reply, Role};
    let t = Some(Duration::from_secs(5));
    let sock = std::os::unix::net::UnixStream::connect(socket).unwrap();
    send_message(&sock, MessageKind::Hello, bytemuck::bytes_of(&Hello::new(Role::Worker, 9, std::process::id())), &[], t).unwrap();
    let m = recv_message(&sock, t).unwrap();
    let r: HelloReply = wire::decode(&m.payload).unwrap();
    assert_eq!(r.status, 0, "{}", r.message());
    let mut reg: MemoryRegistration = bytemuck::Zeroable::zeroed();
    reg.kind = MemoryKind::HostMemfd as u32;
    reg.alloc_id = 1;
    reg.size = len;
    send_message(&sock, MessageKind::RegisterMemory, bytemuck::bytes_of(&reg), &[fd.as_fd()], t).unwrap();
    let m = recv_message(&sock, t).unwrap();
    let reply: Reply = wire::decode(&m.payload).unwrap();
    (reply.status, reply.message().to_string())
}

fn key(i: u32) -> ObjectKey {
    ObjectKey::derive(3, 0, 0, &i.to_le_bytes())
}

fn wait_status(w: &mut Worker, id: umbp_worker::TransferId) -> Vec<BlockStatus> {
    w.wait(id, Duration::from_secs(10)).map(|c| c.statuses).unwrap_or_default()
}

#[test]
fn hugetlb_hole_punch_cannot_kill_the_pool() {
    const HUGE: u64 = 2 << 20;
    if !root_or_skip(&format!("to set {NR_HUGEPAGES}")) {
        return;
    }
    let _pages = match HugePages::exactly_one_free() {
        Ok(g) => g,
        Err(why) => {
            println!("skipped: {why}");
            return;
        }
    };
    let mut pool = PoolProcess::start(&unique_socket("hugetlb"), &["--capacity", "64MiB", "--min-object-size", "4KiB"]);
    let mfd =
        memfd::MemfdOptions::default().allow_sealing(true).hugetlb(Some(memfd::HugetlbSize::Huge2MB)).create("victim-of-its-own").unwrap();
    mfd.as_file().set_len(HUGE).unwrap();
    mfd.add_seals(&[memfd::FileSeal::SealShrink, memfd::FileSeal::SealGrow]).unwrap();
    map_and_fill(mfd.as_file(), HUGE as usize, 0x5a);
    let mut w = Worker::connect(WorkerConfig::new(&pool.socket, 3)).unwrap();
    let fd: OwnedFd = mfd.as_file().try_clone().unwrap().into();
    match w.register_memfd(fd, 0, HUGE) {
        Ok(id) => {
            // The pool took it: punch the page out from under the pool's mapping, take the
            // freed huge page elsewhere, and ask for a copy.
            w.register_layout(0, vec![Segment::new(id, 0, 4096, 4096, 1)]).unwrap();
            let id1 = w.store(0, &[(key(1), 0)]).unwrap();
            assert_eq!(wait_status(&mut w, id1), vec![BlockStatus::Stored]);
            punch_hole(mfd.as_file(), HUGE);
            let thief = memfd::MemfdOptions::default().hugetlb(Some(memfd::HugetlbSize::Huge2MB)).create("thief").unwrap();
            thief.as_file().set_len(HUGE).unwrap();
            map_and_fill(thief.as_file(), HUGE as usize, 1);
            assert_eq!(meminfo("HugePages_Free:"), 0);
            let id2 = w.store(0, &[(key(2), 0)]).unwrap();
            let st = wait_status(&mut w, id2);
            std::thread::sleep(Duration::from_millis(200));
            let died = pool.child.try_wait().unwrap();
            assert!(died.is_none(), "one peer's hole punch killed the pool for everyone: {died:?} (store: {st:?})");
        }
        Err(e) => {
            // Refused by the worker library; the pool must refuse it too.
            let e = e.to_string();
            assert!(e.contains("hugetlb"), "{e}");
            let (status, message) = raw_register_memfd(&pool.socket, mfd.as_file(), HUGE);
            assert_ne!(status, 0, "the pool accepted a hugetlb memfd sealed only against shrinking");
            assert!(message.contains("hugetlb") && message.contains("F_SEAL_WRITE"), "{message}");
            // Sealed against writes, it is taken (stores only).
            let sealed =
                memfd::MemfdOptions::default().allow_sealing(true).hugetlb(Some(memfd::HugetlbSize::Huge2MB)).create("sealed").unwrap();
            sealed.as_file().set_len(HUGE).unwrap();
            sealed.add_seals(&[memfd::FileSeal::SealShrink, memfd::FileSeal::SealGrow, memfd::FileSeal::SealWrite]).unwrap();
            let (status, message) = raw_register_memfd(&pool.socket, sealed.as_file(), HUGE);
            assert!(status == 0 || message.contains("mmap"), "write-sealed hugetlb refused: {message}");
            assert!(pool.child.try_wait().unwrap().is_none());
        }
    }
    pool.kill();
}

/// Item 3's other half, for the record: a shmem memfd sealed only against shrinking does
/// not SIGBUS the pool when a hole is punched; the pool reads zeros (the peer only hurts
/// its own data). Fails if the pool dies or the store is refused.
#[test]
fn shmem_hole_punch_reads_zeros() {
    let pool = PoolProcess::start(&unique_socket("shmem-punch"), &["--capacity", "64MiB", "--min-object-size", "4KiB"]);
    let mfd = memfd::MemfdOptions::default().allow_sealing(true).create("kv").unwrap();
    mfd.as_file().set_len(2 * 4096).unwrap();
    mfd.add_seals(&[memfd::FileSeal::SealShrink]).unwrap();
    let map = map_and_fill(mfd.as_file(), 2 * 4096, 0x77);
    let mut w = Worker::connect(WorkerConfig::new(&pool.socket, 4)).unwrap();
    let fd: OwnedFd = mfd.as_file().try_clone().unwrap().into();
    let id = w.register_memfd(fd, 0, 2 * 4096).unwrap();
    w.register_layout(0, vec![Segment::new(id, 0, 4096, 4096, 2)]).unwrap();
    punch_hole(mfd.as_file(), 4096);
    let t = w.store(0, &[(key(10), 0)]).unwrap();
    assert_eq!(wait_status(&mut w, t), vec![BlockStatus::Stored]);
    let t = w.load(0, &[(key(10), 1)]).unwrap();
    assert_eq!(wait_status(&mut w, t), vec![BlockStatus::Loaded]);
    // SAFETY: block 1 is the second page of our live mapping.
    let page1 = unsafe { std::slice::from_raw_parts(map.add(4096), 4096) };
    assert!(page1.iter().all(|b| *b == 0), "the punched page read as zeros");
    assert!(try_report(&pool.socket).is_ok(), "pool alive");
}

// ---------------------------------------------------------------------------------------
// Item 4: socket directory and pool authentication.

/// Starts umbp-pool at `socket` and returns its exit status and stderr if it exits within
/// 10 s (None: it kept running and was killed).
fn pool_exit(socket: &Path) -> Option<(std::process::ExitStatus, String)> {
    let mut child = Command::new(pool_binary())
        .arg("--socket")
        .arg(socket)
        .args(["--capacity", "16MiB"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
            return Some((status, err));
        }
        if std::os::unix::net::UnixStream::connect(socket).is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

#[test]
fn pool_refuses_a_socket_directory_another_user_controls() {
    if !root_or_skip("to create a directory of another uid") {
        return;
    }
    let base = scratch("sockdir");
    // Pre-created by the attacker (uid 65534), as /tmp/umbp could be.
    let theirs = base.join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    std::os::unix::fs::chown(&theirs, Some(NOBODY), Some(NOBODY)).unwrap();
    // Root's, but anyone may rename entries in it.
    let open = base.join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    for (dir, why) in [(&theirs, "owned by uid 65534"), (&open, "0777")] {
        match pool_exit(&dir.join("pool.sock")) {
            None => panic!("the pool listened in {}, a directory another user controls", dir.display()),
            Some((status, err)) => {
                assert!(!status.success());
                assert!(err.contains(&dir.display().to_string()) && err.contains(why), "{err}");
            }
        }
    }
    // A missing directory is created private to the pool (0750).
    let mine = base.join("mine");
    let pool = PoolProcess::start(&mine.join("pool.sock"), &["--capacity", "16MiB"]);
    assert_eq!(std::fs::metadata(&mine).unwrap().permissions().mode() & 0o7777, 0o750);
    drop(pool);
    let _ = std::fs::remove_dir_all(&base);
}

/// A socket served by uid 65534 where a pool was expected: runs the fake pool, then
/// `client` against it; returns how many bytes the fake pool received.
fn against_fake_pool(tag: &str, client: impl FnOnce(&Path)) -> usize {
    let dir = scratch(tag);
    let (attacker, _) = install_attacker(&dir);
    let sockdir = dir.join("s");
    std::fs::create_dir(&sockdir).unwrap();
    std::os::unix::fs::chown(&sockdir, Some(NOBODY), Some(NOBODY)).unwrap();
    let socket = sockdir.join("pool.sock");
    let (mut child, rx) = spawn_as_nobody(Command::new(&attacker).arg("fake-pool").arg("--socket").arg(&socket));
    assert_eq!(next_line(&rx, "listening"), "listening");
    client(&socket);
    // Unblock a fake pool nobody connected to.
    let _ = std::os::unix::net::UnixStream::connect(&socket);
    let report: serde_json::Value = serde_json::from_str(&next_line(&rx, "fake pool report")).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    report["received"].as_u64().unwrap() as usize
}

#[test]
fn workers_and_schedulers_refuse_a_pool_of_another_uid() {
    if !root_or_skip("to run a fake pool as another uid") {
        return;
    }
    let worker_got = against_fake_pool("fake-worker", |socket| {
        let v = common::run_worker(socket, 1, "per-layer", &["store", "--first-key", "1", "--count", "1"]);
        let e = v["error"].as_str().unwrap_or_else(|| panic!("worker attached to a fake pool: {v}"));
        assert!(e.contains("uid 65534"), "{e}");
    });
    assert_eq!(worker_got, 0, "the worker sent {worker_got} bytes (its Hello) to a socket of uid 65534");
    let sched_got = against_fake_pool("fake-sched", |socket| {
        let e = umbp_scheduler::IndexClient::connect(socket, 1, Duration::from_secs(2)).err().expect("scheduler attached to a fake pool");
        assert!(e.to_string().contains("uid 65534"), "{e}");
    });
    assert_eq!(sched_got, 0, "the scheduler sent {sched_got} bytes to a socket of uid 65534");
    // Configured as the pool's uid (UMBP_POOL_UID), the same socket is trusted.
    let trusted = against_fake_pool("fake-trusted", |socket| {
        let out = Command::new(workspace_binary("umbp-test-worker"))
            .arg("--socket")
            .arg(socket)
            .args(["--timeout-ms", "500", "store", "--first-key", "1", "--count", "1"])
            .env("UMBP_POOL_UID", "65534")
            .stderr(Stdio::null())
            .output()
            .unwrap();
        assert!(!out.status.success());
    });
    assert!(trusted > 0, "with UMBP_POOL_UID=65534 the worker should have said Hello");
}

#[test]
fn ringtool_refuses_a_pool_of_another_uid() {
    if !root_or_skip("to run a fake pool as another uid") {
        return;
    }
    let got = against_fake_pool("fake-ringtool", |socket| {
        let out = Command::new(workspace_binary("ringtool"))
            .arg("dump")
            .arg("--socket")
            .arg(socket)
            .env_remove("UMBP_POOL_UID")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("uid 65534"), "ringtool talked to a fake pool: {err}");
    });
    assert_eq!(got, 0, "ringtool sent {got} bytes (its Hello) to a socket of uid 65534");
}

// ---------------------------------------------------------------------------------------
// Item 13: a peer the pool sees with pid 0 (SO_PEERCRED across pid namespaces).

#[test]
fn peer_in_another_pid_namespace_is_served_without_process_memory() {
    if !root_or_skip("for unshare --pid") {
        return;
    }
    // The pool in a new pid namespace: peers outside it (this test) have no pid there.
    let socket = unique_socket("pidns");
    /// Kills the pool (and its unshare parent) even when an assertion fails.
    struct Killed(Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut pool = Killed(
        Command::new("unshare")
            .args(["--pid", "--fork", "--mount-proc", "--kill-child"])
            .arg(pool_binary())
            .arg("--socket")
            .arg(&socket)
            .args(["--capacity", "64MiB", "--min-object-size", "4KiB"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    if !eventually(Duration::from_secs(20), || std::os::unix::net::UnixStream::connect(&socket).is_ok()) {
        println!("skipped: the pool did not start under unshare --pid ({:?})", pool.0.try_wait());
        return;
    }
    let mut w = Worker::connect(WorkerConfig::new(&socket, 5)).unwrap();
    let mut buf = vec![0u8; 4096];
    // SAFETY: `buf` outlives `w` within this test, and the registration is refused anyway.
    let e =
        unsafe { w.register_memory(MemorySpec::HostProcess { ptr: buf.as_mut_ptr() as usize, len: buf.len() }) }.unwrap_err().to_string();
    assert!(e.contains("pid namespace"), "HostProcess from pid 0 must be refused, saying why: {e}");
    // Memfds need no pid: served.
    let mfd = memfd::MemfdOptions::default().allow_sealing(true).create("kv").unwrap();
    mfd.as_file().set_len(4096).unwrap();
    mfd.add_seals(&[memfd::FileSeal::SealShrink]).unwrap();
    map_and_fill(mfd.as_file(), 4096, 9);
    let fd: OwnedFd = mfd.as_file().try_clone().unwrap().into();
    let id = w.register_memfd(fd, 0, 4096).unwrap();
    w.register_layout(0, vec![Segment::new(id, 0, 4096, 4096, 1)]).unwrap();
    let t = w.store(0, &[(key(20), 0)]).unwrap();
    assert_eq!(wait_status(&mut w, t), vec![BlockStatus::Stored]);
    assert!(pool.0.try_wait().unwrap().is_none(), "pool alive");
}
