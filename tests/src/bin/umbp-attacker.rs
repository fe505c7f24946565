//! The hostile peers of tests/tests/attacks.rs (issue #13), as a separate program so that
//! the tests can run them as another uid and exec them setuid.
//!
//! - `victim`: stands for a privileged program: maps a secret at a fixed address, prints
//!   "ready euid=N" and sleeps. The tests install a copy of this binary setuid root.
//! - `exec-swap`: connects as a worker, forks, and lets the connecting process exec the
//!   victim while the child keeps the socket, then asks the pool to copy the victim's
//!   secret into the pool and back into the attacker's memfd (item 1).
//! - `fake-pool`: listens on a socket in place of the pool and reports what a client sent.

use std::io::{BufRead, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use clap::{Parser, Subcommand};
use umbp_worker::{MemorySpec, ObjectKey, Segment, Worker, WorkerConfig};

const SECRET: &[u8] = b"VICTIM-SECRET-0123456789";
const PAGE: usize = 4096;

#[derive(Parser)]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    Victim {
        #[arg(long)]
        addr: u64,
    },
    ExecSwap {
        #[arg(long)]
        socket: std::path::PathBuf,
        #[arg(long)]
        victim: std::path::PathBuf,
        #[arg(long)]
        addr: u64,
        /// Register the address before the exec (else after it).
        #[arg(long)]
        before: bool,
    },
    FakePool {
        #[arg(long)]
        socket: std::path::PathBuf,
    },
}

fn map_fixed(addr: u64, fill: &[u8]) {
    // SAFETY: a fresh anonymous mapping at an address nothing else uses (NOREPLACE fails
    // otherwise); written only here.
    unsafe {
        let p = libc::mmap(
            addr as *mut libc::c_void,
            PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        );
        assert_eq!(p as u64, addr, "mmap at {addr:#x}: {}", std::io::Error::last_os_error());
        let page = std::slice::from_raw_parts_mut(p.cast::<u8>(), PAGE);
        for chunk in page.chunks_mut(fill.len()) {
            chunk.copy_from_slice(&fill[..chunk.len()]);
        }
    }
}

fn main() {
    let args = Args::parse();
    match args.cmd {
        Cmd::Victim { addr } => {
            map_fixed(addr, SECRET);
            // SAFETY: no preconditions.
            let euid = unsafe { libc::geteuid() };
            println!("ready euid={euid}");
            std::thread::sleep(Duration::from_secs(60));
        }
        Cmd::ExecSwap { socket, victim, addr, before } => exec_swap(&socket, &victim, addr, before),
        Cmd::FakePool { socket } => fake_pool(&socket),
    }
}

fn exec_swap(socket: &std::path::Path, victim: &std::path::Path, addr: u64, before: bool) {
    let mut w = Worker::connect(WorkerConfig::new(socket, 7)).unwrap_or_else(|e| {
        println!("{}", serde_json::json!({ "error": format!("connect: {e}") }));
        std::process::exit(3)
    });
    map_fixed(addr, b"ATTACKER");
    // The attacker's own landing zone: a memfd, reached by the pool without any pid.
    let mfd = memfd::MemfdOptions::default().allow_sealing(true).create("attacker").unwrap();
    mfd.as_file().set_len(PAGE as u64).unwrap();
    mfd.add_seals(&[memfd::FileSeal::SealShrink, memfd::FileSeal::SealGrow]).unwrap();
    let fd: OwnedFd = mfd.as_file().try_clone().unwrap().into();
    let local = w.register_memfd(fd, 0, PAGE as u64).expect("register memfd");
    w.register_layout(1, vec![Segment::new(local, 0, PAGE as u64, PAGE as u64, 1)]).expect("layout 1");
    let register = |w: &mut Worker| -> Result<(), String> {
        // SAFETY: `addr` is this process's own fixed mapping of PAGE bytes (map_fixed above),
        // never unmapped, and only read through raw pointers.
        let id = unsafe { w.register_memory(MemorySpec::HostProcess { ptr: addr as usize, len: PAGE }) }.map_err(|e| e.to_string())?;
        w.register_layout(0, vec![Segment::new(id, 0, PAGE as u64, PAGE as u64, 1)]).map(|_| ()).map_err(|e| e.to_string())
    };
    let mut registered = if before { Some(register(&mut w)) } else { None };
    let mut p = [0i32; 2];
    // SAFETY: p has room for two fds.
    assert_eq!(unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: this program has no other threads (the worker library runs none), so the
    // child may keep using everything after fork.
    let pid = unsafe { libc::fork() };
    if pid > 0 {
        // The process the pool knows by SO_PEERCRED becomes the victim.
        // SAFETY: dup2 onto stdout; the pipe's write end stays CLOEXEC-free on fd 1.
        unsafe { libc::dup2(p[1], 1) };
        let err =
            std::os::unix::process::CommandExt::exec(std::process::Command::new(victim).args(["victim", "--addr", &addr.to_string()]));
        eprintln!("exec {}: {err}", victim.display());
        std::process::exit(4);
    }
    // SAFETY: the read end is ours; the write end belongs to the victim now.
    unsafe { libc::close(p[1]) };
    // SAFETY: p[0] is an open fd we own.
    let mut ready = std::io::BufReader::new(std::fs::File::from(unsafe { OwnedFd::from_raw_fd(p[0]) }));
    let mut line = String::new();
    let _ = ready.read_line(&mut line);
    let victim_line = line.trim().to_string();
    if registered.is_none() {
        registered = Some(register(&mut w));
    }
    let mut out = serde_json::json!({ "victim": victim_line, "register": "ok" });
    if let Some(Err(e)) = &registered {
        out["register"] = e.clone().into();
        println!("{out}");
        return;
    }
    let key = ObjectKey::derive(7, 0, 0, b"stolen");
    let status = |w: &mut Worker, id| w.wait(id, Duration::from_secs(5)).map(|c| format!("{:?}", c.statuses)).unwrap_or("timeout".into());
    let stored = match w.store(0, &[(key, 0)]) {
        Ok(id) => status(&mut w, id),
        Err(e) => e.to_string(),
    };
    let loaded = match w.load(1, &[(key, 0)]) {
        Ok(id) => status(&mut w, id),
        Err(e) => e.to_string(),
    };
    let mut got = vec![0u8; PAGE];
    let mut f = mfd.as_file();
    use std::io::Seek;
    f.seek(std::io::SeekFrom::Start(0)).unwrap();
    f.read_exact(&mut got).unwrap();
    out["store"] = stored.into();
    out["load"] = loaded.into();
    out["leaked"] = got.windows(SECRET.len()).any(|w| w == SECRET).into();
    println!("{out}");
}

fn fake_pool(socket: &std::path::Path) {
    let l = std::os::unix::net::UnixListener::bind(socket).expect("bind");
    println!("listening");
    let (mut s, _) = l.accept().expect("accept");
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut buf = [0u8; 4096];
    let mut received = 0;
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => received += n,
        }
    }
    let _ = s.as_raw_fd();
    println!("{}", serde_json::json!({ "received": received }));
}
