//! Endpoints as the seed's guide writes them (issue #33 item 1): `unix:///abs/path`
//! accepted wherever an endpoint is read (umbp-pool's `UMBP_STANDALONE_ADDRESS` and
//! `--socket`, the worker, the scheduler's index client, ringtool), `tcp://` refused by
//! each with the same message. Real `umbp-pool` and `ringtool` processes.
//!
//! Needs the workspace binaries (`cargo build --workspace --bins`).

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::*;
use umbp_scheduler::IndexClient;
use umbp_worker::{MemorySpec, Worker, WorkerConfig, WorkerError};

/// The refusal's common tail (umbp_ipc::endpoint).
const ONLY_UNIX: &str = "only unix sockets are supported (give a socket path or unix:///path/to/umbp.sock)";
const TCP: &str = "tcp://127.0.0.1:5555";

fn output(cmd: &mut Command) -> (Output, String) {
    let out = cmd.stdin(Stdio::null()).output().expect("run");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, err)
}

/// Everything under `dir`, for the error message (a pool listening at a relative
/// `unix:/...` path shows up here).
fn listing(dir: &Path) -> Vec<String> {
    let mut v = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            v.push(e.path().strip_prefix(dir).unwrap().display().to_string());
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                stack.push(e.path());
            }
        }
    }
    v
}

/// The seed's `UMBP_STANDALONE_ADDRESS=unix:///...`: the pool listens at the absolute
/// path (not at `./unix:/...` under its working directory); a worker, a scheduler and
/// ringtool given the same `unix://` value attach.
#[test]
fn seed_unix_address_from_the_environment() {
    let socket = unique_socket("endpoint-env");
    let address = format!("unix://{}", socket.display());
    let cwd = tempfile::tempdir().unwrap();
    let child = pool_command(&pool_binary())
        .args(["--capacity", "64MiB"])
        .env("UMBP_STANDALONE_ADDRESS", &address)
        .env("RUST_LOG", "warn")
        .current_dir(cwd.path())
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn umbp-pool");
    let mut pool = Killed(child, socket.clone());
    let listening = eventually(Duration::from_secs(20), || std::os::unix::net::UnixStream::connect(&socket).is_ok());
    let stray = listing(cwd.path());
    let exited = pool.0.try_wait().ok().flatten();
    assert!(
        listening,
        "umbp-pool with UMBP_STANDALONE_ADDRESS={address} does not listen at {} (exit: {exited:?}; its working directory holds {stray:?})",
        socket.display()
    );
    assert!(stray.is_empty(), "umbp-pool created {stray:?} under its working directory");

    // The Rust worker, given the unix:// form, attaches and its memory registers.
    let mut mem = vec![0u8; 1 << 20];
    let mut w = Worker::connect(WorkerConfig::new(&address, 0x5eed)).expect("worker attaches through unix://");
    // SAFETY: `mem` outlives `w` (dropped explicitly below, before `mem`) and is not
    // touched while registered.
    unsafe { w.register_memory(MemorySpec::HostProcess { ptr: mem.as_mut_ptr() as usize, len: mem.len() }) }.expect("register memory");
    drop(w);
    drop(mem);

    // The scheduler's index client too.
    let idx = IndexClient::connect(Path::new(&address), 0x5eed, Duration::from_secs(5)).expect("index client attaches through unix://");
    drop(idx);

    // ringtool, by flag and by the same environment variable.
    for by_env in [false, true] {
        let mut cmd = Command::new(workspace_binary("ringtool"));
        cmd.args(["dump", "--json"]);
        if by_env {
            cmd.env("UMBP_STANDALONE_ADDRESS", &address);
        } else {
            cmd.args(["--socket", &address]).env_remove("UMBP_STANDALONE_ADDRESS");
        }
        let (out, err) = output(&mut cmd);
        assert!(out.status.success(), "ringtool dump ({}) failed: {err}", if by_env { "env" } else { "--socket" });
    }
}

/// A pool started by hand: killed and its socket directory removed when dropped (also
/// when an assertion fails).
struct Killed(std::process::Child, std::path::PathBuf);

impl Drop for Killed {
    fn drop(&mut self) {
        kill_and_clean(&mut self.0, &self.1);
    }
}

/// `tcp://` is refused by every reader of an endpoint, each naming where the value came
/// from, with the same message.
#[test]
fn tcp_address_refused_everywhere_with_one_message() {
    let cwd = tempfile::tempdir().unwrap();
    // umbp-pool: by variable and by flag; it exits at once and listens nowhere.
    for by_env in [true, false] {
        let mut cmd = pool_command(&pool_binary());
        cmd.args(["--capacity", "64MiB"]).current_dir(cwd.path());
        if by_env {
            cmd.env("UMBP_STANDALONE_ADDRESS", TCP);
        } else {
            cmd.args(["--socket", TCP]).env_remove("UMBP_STANDALONE_ADDRESS");
        }
        let (out, err) = output(&mut cmd);
        assert!(!out.status.success(), "umbp-pool accepted {TCP}");
        assert!(
            err.contains("UMBP_STANDALONE_ADDRESS") && err.contains(&format!("'{TCP}' is a tcp address; {ONLY_UNIX}")),
            "umbp-pool: {err}"
        );
    }
    assert!(listing(cwd.path()).is_empty(), "umbp-pool created {:?}", listing(cwd.path()));

    // ringtool: by flag and by variable.
    let (out, err) = output(Command::new(workspace_binary("ringtool")).args(["dump", "--socket", TCP]));
    assert!(!out.status.success() && err.contains(&format!("--socket: '{TCP}' is a tcp address; {ONLY_UNIX}")), "ringtool --socket: {err}");
    let (out, err) = output(Command::new(workspace_binary("ringtool")).arg("dump").env("UMBP_STANDALONE_ADDRESS", TCP));
    assert!(
        !out.status.success() && err.contains(&format!("UMBP_STANDALONE_ADDRESS: '{TCP}' is a tcp address; {ONLY_UNIX}")),
        "ringtool with the variable: {err}"
    );

    // The worker and the scheduler refuse it before dialling anything.
    let mut cfg = WorkerConfig::new(TCP, 1);
    cfg.startup_timeout = Duration::from_secs(30);
    let t = std::time::Instant::now();
    match Worker::connect(cfg) {
        Err(WorkerError::Invalid(m)) => assert!(m.contains(&format!("endpoint: '{TCP}' is a tcp address; {ONLY_UNIX}")), "worker: {m}"),
        Err(e) => panic!("worker: expected an invalid endpoint, got {e}"),
        Ok(_) => panic!("worker attached to {TCP}"),
    }
    assert!(t.elapsed() < Duration::from_secs(5), "the worker retried a refused endpoint");
    match IndexClient::connect(Path::new(TCP), 1, Duration::from_secs(30)) {
        Err(e) => assert!(e.to_string().contains(&format!("endpoint: '{TCP}' is a tcp address; {ONLY_UNIX}")), "scheduler: {e}"),
        Ok(_) => panic!("index client attached to {TCP}"),
    }
}
