//! A thin safe layer over `nixl-sys`: one NIXL agent with a UCX backend, one region
//! registered once, metadata out and in, and READs of (remote offset, len) into local DRAM
//! with a bounded wait. A node runs two (`node.rs`): the export agent (the export area; its
//! metadata goes to peers) and the reader (the pool's DRAM; its metadata never leaves the
//! process). Nothing here knows about keys or peers' catalogs.
//!
//! ## Where the library comes from
//! `nixl-sys` is built with its `stub-api` feature: the build needs no NIXL, and the first
//! NIXL call `dlopen`s `libnixl_capi.so` by its soname — and `abort`s the process when that
//! fails. So [`load_library`] runs first (every constructor here calls it): it opens the
//! library itself, from `$UMBP_NIXL_LIB` (the file, or the directory holding it) or else by
//! soname (`LD_LIBRARY_PATH`, ld.so.cache), and returns a clear error naming
//! `pip install nixl-cu12` and the variable instead. Once it is loaded, the stubs'
//! `dlopen("libnixl_capi.so")` finds the same object by its soname. The wheel's libraries
//! carry `RPATH=$ORIGIN`, and NIXL finds its UCX plugin in `plugins/` beside `libnixl.so`,
//! so the one path is all it takes. A pool without cluster flags never calls any of this.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The NIXL binding, for tests that act as a peer at the NIXL level.
pub use nixl_sys;
use nixl_sys::{
    Agent as NixlAgent, AgentConfig, MemType, NixlError, OptArgs, RegistrationHandle, ThreadSync, XferDescList, XferOp, XferStatus,
};

/// Environment variable naming `libnixl_capi.so` or the directory that holds it.
pub const LIB_ENV: &str = "UMBP_NIXL_LIB";
/// The library's file name (and soname).
pub const LIB_NAME: &str = "libnixl_capi.so";
/// What to install, for error messages.
pub const INSTALL_HINT: &str = "pip install nixl-cu12 (scripts/setup-nixl.sh installs it into a venv and prints the path)";

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("cluster tier needs NIXL: {LIB_NAME} could not be loaded from {tried} ({reason}); install it with `{INSTALL_HINT}` and set {LIB_ENV} to the library or its directory")]
    LibraryNotFound { tried: String, reason: String },
    #[error("NIXL {op} failed: {source}")]
    Nixl {
        op: &'static str,
        #[source]
        source: NixlError,
    },
    #[error("NIXL has no UCX backend plugin (plugins found: {found}); is the plugins/ directory beside libnixl.so?")]
    NoUcx { found: String },
    #[error("remote read of {len} bytes at offset {offset} is outside peer {peer}'s registered {region} bytes")]
    OutOfRange { peer: String, offset: u64, len: u64, region: u64 },
    #[error("peer agent {0} is not loaded (no metadata, or dropped)")]
    UnknownPeer(String),
    #[error("remote read from {peer} failed: {source}")]
    ReadFailed {
        peer: String,
        #[source]
        source: NixlError,
    },
    /// The read did not complete in time. Its request is kept (`PendingRead::give_up`)
    /// and the backend may still write the destination: the caller must not reuse that
    /// memory until the kept request is final. `peer` names the holder's agent and, after
    /// a `#`, the given-up read (the tag its quarantine is filed under).
    #[error("remote read from {peer} did not complete within {timeout:?}")]
    Timeout { peer: String, timeout: Duration },
}

impl TransportError {
    /// Whether the destination may still be written by the transfer after this error
    /// (the caller quarantines it instead of freeing it).
    pub fn destination_tainted(&self) -> bool {
        matches!(self, Self::Timeout { .. })
    }
}

fn nixl(op: &'static str) -> impl FnOnce(NixlError) -> TransportError {
    move |source| TransportError::Nixl { op, source }
}

static LIBRARY: OnceLock<Result<PathBuf, String>> = OnceLock::new();

/// The path `load_library` tries: `$UMBP_NIXL_LIB` (a file, or a directory holding
/// `libnixl_capi.so`), else the bare soname.
pub fn library_candidate(env: Option<&str>) -> PathBuf {
    match env {
        Some(v) if !v.is_empty() => {
            let p = PathBuf::from(v);
            if p.is_dir() {
                p.join(LIB_NAME)
            } else {
                p
            }
        }
        _ => PathBuf::from(LIB_NAME),
    }
}

/// Loads `libnixl_capi.so` once per process (see the module doc). Returns where from.
pub fn load_library() -> Result<PathBuf, TransportError> {
    let r = LIBRARY.get_or_init(|| {
        let env = std::env::var(LIB_ENV).ok();
        let path = library_candidate(env.as_deref());
        // SAFETY: loading a shared library runs its initialisers; libnixl_capi and what it
        // links are ordinary C++ libraries whose initialisers only set up their own state.
        let lib = unsafe { libloading::os::unix::Library::open(Some(&path), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        match lib {
            Ok(lib) => {
                // Kept loaded for the life of the process: the stubs resolve into it.
                std::mem::forget(lib);
                tracing::info!(path = %path.display(), "NIXL library loaded");
                Ok(path)
            }
            Err(_) if path.is_absolute() && !path.exists() => Err(format!("{}|no such file", path.display())),
            Err(e) => Err(format!("{}|{e}", path.display())),
        }
    });
    r.clone().map_err(|s| {
        let (tried, reason) = s.split_once('|').unwrap_or((s.as_str(), ""));
        let tried = if Path::new(tried).is_absolute() { tried.to_string() } else { format!("{tried} (by soname: {LIB_ENV} is unset)") };
        TransportError::LibraryNotFound { tried, reason: reason.to_string() }
    })
}

/// Whether the library can be loaded here (tests that need it skip otherwise).
pub fn available() -> bool {
    load_library().is_ok()
}

/// UCX settings this agent needs, after the plugin's own `engine_config` (`KEY=VALUE,...`,
/// keys without `UCX_`; NIXL applies each unless `UCX_KEY` is set in the environment).
///
/// `TCP_CONN_NB=y`: UCX's TCP transport otherwise connects with a blocking `connect()`
/// inside `ucp_ep_create`, i.e. inside [`Agent::load_peer`], holding the UCP worker's lock.
/// When the peer's address does not answer (partitioned just as its `Join` arrived, or a
/// data network that is down while the control network is up), that call blocks for the
/// kernel's SYN retries (14 s measured here, minutes over a router) and the worker makes no
/// progress meanwhile: NIXL's progress thread spins on the lock, so no read this pool makes
/// *or serves* completes (issue #17, docs/cluster.md "What was tested here").
pub const UCX_ENGINE_CONFIG: &str = "TCP_CONN_NB=y";

/// `given` (the plugin's default `engine_config`) with [`UCX_ENGINE_CONFIG`] appended.
pub fn ucx_engine_config(given: &str) -> String {
    let given = given.trim_matches(',');
    if given.is_empty() {
        UCX_ENGINE_CONFIG.to_string()
    } else {
        format!("{given},{UCX_ENGINE_CONFIG}")
    }
}

/// A DRAM range this agent registered. Deregistered on drop.
struct Region {
    base: u64,
    len: u64,
    _handle: RegistrationHandle,
}

#[derive(Debug)]
struct RawRegion {
    ptr: *const u8,
    len: usize,
}
// SAFETY: only an address and a length, handed to NIXL for registration.
unsafe impl Send for RawRegion {}
// SAFETY: as above.
unsafe impl Sync for RawRegion {}

impl nixl_sys::MemoryRegion for RawRegion {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.ptr
    }
    fn size(&self) -> usize {
        self.len
    }
}

impl nixl_sys::NixlDescriptor for RawRegion {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }
    fn device_id(&self) -> u64 {
        0
    }
}

/// A peer's registered region (its export area) as this agent knows it (from `Join`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerRegion {
    /// NIXL agent name (from its metadata).
    pub agent: String,
    /// Address and length of the peer's registered region in the peer's address space.
    pub base: u64,
    pub len: u64,
}

/// One piece of a remote read: `len` bytes at `remote_offset` of the peer's region into
/// `local` (which must lie in this agent's registered region).
#[derive(Debug, Clone, Copy)]
pub struct ReadPiece {
    pub remote_offset: u64,
    pub local: *mut u8,
    pub len: u64,
}

/// One NIXL agent with a UCX backend and (after [`Agent::register_dram`]) one registered
/// DRAM region. Thread-safe (NIXL strict thread sync; nixl-sys locks the handle).
pub struct Agent {
    agent: NixlAgent,
    name: String,
    region: Option<Region>,
    opt: OptArgs,
}

// SAFETY: nixl-sys's Agent and Backend are Send + Sync; OptArgs is a handle NIXL only reads
// while posting (the agent is created with strict thread sync).
unsafe impl Send for Agent {}
// SAFETY: as above.
unsafe impl Sync for Agent {}

impl Agent {
    /// Loads the library if needed and creates agent `name` (unique in the cluster) with a
    /// UCX backend. UCX picks its transports from the environment (`UCX_TLS`,
    /// `UCX_NET_DEVICES`): RDMA where there is RDMA, TCP otherwise.
    pub fn new(name: &str) -> Result<Self, TransportError> {
        load_library()?;
        // NIXL's UCX progress thread polls the workers' event fds with a fallback timer of
        // ceil(pthr_delay) ms; the nixl-sys default of 0 makes that a busy loop that takes a
        // whole core (on a 2-core machine: half of it, and the transfers crawl).
        let cfg = AgentConfig { thread_sync: ThreadSync::Strict, pthr_delay_us: 1000, ..AgentConfig::default() };
        let agent = NixlAgent::new_configured(name, &cfg).map_err(nixl("create agent"))?;
        let plugins = agent.get_available_plugins().map_err(nixl("list plugins"))?;
        let names: Vec<String> = plugins.iter().filter_map(|p| p.ok().map(str::to_string)).collect();
        if !names.iter().any(|n| n == "UCX") {
            return Err(TransportError::NoUcx { found: names.join(",") });
        }
        let (_mems, mut params) = agent.get_plugin_params("UCX").map_err(nixl("UCX plugin params"))?;
        let given = params
            .iter()
            .map_err(nixl("UCX plugin params"))?
            .filter_map(Result::ok)
            .find(|(k, _)| *k == "engine_config")
            .map(|(_, v)| v.to_string())
            .unwrap_or_default();
        let engine_config = ucx_engine_config(&given);
        params.set("engine_config", &engine_config).map_err(nixl("UCX engine config"))?;
        tracing::debug!(engine_config, "UCX backend configuration");
        let backend = agent.create_backend("UCX", &params).map_err(nixl("create UCX backend"))?;
        let mut opt = OptArgs::new().map_err(nixl("opt args"))?;
        opt.add_backend(&backend).map_err(nixl("opt args backend"))?;
        Ok(Self { agent, name: name.to_string(), region: None, opt })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The nixl-sys agent underneath (benchmarks drive it directly as their baseline).
    pub fn raw(&self) -> &NixlAgent {
        &self.agent
    }

    /// Optional arguments naming this agent's UCX backend.
    pub fn opt_args(&self) -> &OptArgs {
        &self.opt
    }

    /// Registers `len` bytes at `ptr` as this agent's one region: what peers holding this
    /// agent's metadata can address (READ and, as NIXL's UCX backend registers with
    /// UCX's default protection, WRITE), and the destination of this agent's own reads.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay mapped for as long as this agent lives; whoever gets this
    /// agent's metadata may read and write any of it at any time.
    pub unsafe fn register_dram(&mut self, ptr: *mut u8, len: usize) -> Result<(), TransportError> {
        let raw = RawRegion { ptr, len };
        let handle = self.agent.register_memory(&raw, Some(&self.opt)).map_err(nixl("register DRAM"))?;
        self.region = Some(Region { base: ptr as u64, len: len as u64, _handle: handle });
        Ok(())
    }

    /// This agent's registered region as peers address it.
    pub fn local_region(&self) -> Option<PeerRegion> {
        self.region.as_ref().map(|r| PeerRegion { agent: self.name.clone(), base: r.base, len: r.len })
    }

    /// This agent's metadata blob (connection info and registrations) for peers.
    pub fn metadata(&self) -> Result<Vec<u8>, TransportError> {
        self.agent.get_local_md().map_err(nixl("get local metadata"))
    }

    /// Loads a peer's metadata; returns the peer's agent name.
    pub fn load_peer(&self, metadata: &[u8]) -> Result<String, TransportError> {
        self.agent.load_remote_md(metadata).map_err(nixl("load remote metadata"))
    }

    /// Whether `agent`'s metadata is loaded here.
    pub fn has_peer(&self, agent: &str) -> bool {
        self.agent.check_remote_metadata(agent, None)
    }

    /// Forgets a peer (dead or left): later reads from it fail with `UnknownPeer`.
    pub fn forget_peer(&self, agent: &str) {
        let t = std::time::Instant::now();
        if let Err(e) = self.agent.invalidate_remote_md(agent) {
            tracing::debug!(agent, "invalidate remote metadata: {e}");
        }
        tracing::debug!(agent, took_us = t.elapsed().as_micros() as u64, "peer's NIXL metadata invalidated");
    }

    /// Reads `pieces` from `peer` and waits at most `timeout` for them.
    ///
    /// # Safety
    /// Every `pieces[i].local..+len` must lie in this agent's registered region and be
    /// memory nobody else reads or writes until this returns — and, on an error for which
    /// [`TransportError::destination_tainted`] is true, forever after.
    pub unsafe fn read(&self, peer: &PeerRegion, pieces: &[ReadPiece], timeout: Duration) -> Result<(), TransportError> {
        let deadline = Instant::now() + timeout;
        // SAFETY: forwarded.
        let mut read = unsafe { self.post_read(peer, pieces) }?;
        let mut backoff = Backoff::default();
        loop {
            if read.poll()? {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(read.timed_out(timeout));
            }
            backoff.wait();
        }
    }

    /// Posts a read of `pieces` from `peer` and returns at once; [`PendingRead::poll`]
    /// tells when it is done. Several reads (from several peers) can be in flight at once,
    /// so a hung peer holds up only its own read.
    ///
    /// # Safety
    /// As for [`Self::read`], until the returned read has completed — or forever, if it is
    /// dropped before [`PendingRead::poll`] returned `Ok(true)` or an error.
    pub unsafe fn post_read(&self, peer: &PeerRegion, pieces: &[ReadPiece]) -> Result<PendingRead<'_>, TransportError> {
        let local_region = self.region.as_ref().expect("read before register_dram");
        let mut local = XferDescList::new(MemType::Dram).map_err(nixl("xfer dlist"))?;
        let mut remote = XferDescList::new(MemType::Dram).map_err(nixl("xfer dlist"))?;
        for p in pieces {
            if p.remote_offset.checked_add(p.len).is_none_or(|end| end > peer.len) {
                return Err(TransportError::OutOfRange { peer: peer.agent.clone(), offset: p.remote_offset, len: p.len, region: peer.len });
            }
            let l = p.local as u64;
            assert!(
                l >= local_region.base && l + p.len <= local_region.base + local_region.len,
                "read destination outside the registered region"
            );
            local.add_desc(p.local as usize, p.len as usize, 0);
            remote.add_desc((peer.base + p.remote_offset) as usize, p.len as usize, 0);
        }
        if !self.agent.check_remote_metadata(&peer.agent, None) {
            return Err(TransportError::UnknownPeer(peer.agent.clone()));
        }
        let fail = |source| TransportError::ReadFailed { peer: peer.agent.clone(), source };
        let posted = Instant::now();
        let req = self.agent.create_xfer_req(XferOp::Read, &local, &remote, &peer.agent, Some(&self.opt)).map_err(fail)?;
        let in_progress = self.agent.post_xfer_req(&req, Some(&self.opt)).map_err(fail)?;
        tracing::debug!(agent = %peer.agent, pieces = pieces.len(), in_progress, post_us = posted.elapsed().as_micros() as u64, "remote read posted");
        Ok(PendingRead { agent: self, req, peer: peer.agent.clone(), done: !in_progress, posted })
    }
}

/// A posted read ([`Agent::post_read`]). Dropping it while in progress releases the
/// request, but the backend may still write the destination later (see `post_read`): a
/// caller that stops waiting keeps it with [`PendingRead::give_up`] instead.
pub struct PendingRead<'a> {
    agent: &'a Agent,
    req: nixl_sys::XferRequest,
    peer: String,
    done: bool,
    posted: Instant,
}

impl PendingRead<'_> {
    /// Whether the read has completed (each call also progresses UCX).
    pub fn poll(&mut self) -> Result<bool, TransportError> {
        if !self.done {
            let status = self
                .agent
                .agent
                .get_xfer_status(&self.req)
                .map_err(|source| TransportError::ReadFailed { peer: self.peer.clone(), source })?;
            self.done = matches!(status, XferStatus::Success);
            if self.done {
                tracing::debug!(agent = %self.peer, took_us = self.posted.elapsed().as_micros() as u64, "remote read completed");
            }
        }
        Ok(self.done)
    }

    /// Time since the read was posted.
    pub fn since_posted(&self) -> Duration {
        self.posted.elapsed()
    }

    /// The error for a read given up after `timeout` (its destination is tainted).
    pub fn timed_out(&self, timeout: Duration) -> TransportError {
        TransportError::Timeout { peer: self.peer.clone(), timeout }
    }

    /// Gives the read up without releasing its request: the caller stops waiting for it,
    /// but keeps the request and polls it ([`Agent::poll_given_up`]) until NIXL reports it
    /// final. Releasing a posted request does not stop it: NIXL's UCX backend cancels the
    /// UCX requests on release, and UCX cancels only tag/stream receives (an RMA GET goes
    /// on; openucx/ucx#9584), then frees the request while the data still arrives. So the
    /// destination may be reused only once this read is final.
    pub fn give_up(self) -> GivenUpRead {
        GivenUpRead { req: self.req, peer: self.peer, done: self.done, given_up: Instant::now() }
    }
}

/// A read its caller gave up on (it timed out), kept so that its end can be seen: the
/// request is released only when it is final (or when this is dropped, which callers do
/// only once it is final or the destination is never reused; see [`PendingRead::give_up`]).
pub struct GivenUpRead {
    req: nixl_sys::XferRequest,
    peer: String,
    done: bool,
    given_up: Instant,
}

impl std::fmt::Debug for GivenUpRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GivenUpRead").field("peer", &self.peer).field("given_up", &self.given_up).finish()
    }
}

/// How a given-up read ended, once it has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadEnd {
    /// Still in progress: its destination may still be written.
    Pending,
    /// It completed: every byte landed (after its caller gave up; nothing more lands).
    Completed,
    /// NIXL reports an error for it. UCX completes a request with an error only once it
    /// has finished with it: a failed endpoint purges every outstanding request on it (TCP:
    /// the socket is closed; RDMA: the QP is in error and flushes), so nothing lands after.
    Failed(String),
}

impl GivenUpRead {
    /// The peer (its agent name) the read was from.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// How long ago its caller gave it up.
    pub fn given_up_for(&self) -> Duration {
        self.given_up.elapsed()
    }
}

impl Agent {
    /// Polls a read this agent posted and its caller gave up on (each call also
    /// progresses UCX). Once it returns anything but [`ReadEnd::Pending`], the read
    /// writes nothing more and the caller may release it (drop) and reuse its destination.
    pub fn poll_given_up(&self, r: &mut GivenUpRead) -> ReadEnd {
        if r.done {
            return ReadEnd::Completed;
        }
        match self.agent.get_xfer_status(&r.req) {
            Ok(XferStatus::Success) => {
                r.done = true;
                ReadEnd::Completed
            }
            Ok(XferStatus::InProgress) => ReadEnd::Pending,
            // The backend's status of the transfer (the C API maps every transfer error,
            // a disconnect or a cancel included, to this one).
            Err(e @ NixlError::BackendError) => ReadEnd::Failed(e.to_string()),
            // An API-level refusal (bad or unknown handle) says nothing of the transfer:
            // it may still be running, so it is not final.
            Err(e) => {
                tracing::debug!(peer = %r.peer, "status of a given-up read: {e} (not final)");
                ReadEnd::Pending
            }
        }
    }
}

/// How a waiter polls a transfer's status: spin briefly, then yield, then sleep 50 µs
/// between polls (each poll also progresses UCX).
#[derive(Debug, Default)]
pub struct Backoff(u32);

impl Backoff {
    pub fn wait(&mut self) {
        self.0 = self.0.saturating_add(1);
        if self.0 < 256 {
            std::hint::spin_loop();
        } else if self.0 < 1024 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidate_is_the_env_file_or_dir_or_the_soname() {
        assert_eq!(library_candidate(None), PathBuf::from(LIB_NAME));
        assert_eq!(library_candidate(Some("")), PathBuf::from(LIB_NAME));
        assert_eq!(library_candidate(Some("/x/libnixl_capi.so")), PathBuf::from("/x/libnixl_capi.so"));
        let d = tempfile::tempdir().unwrap();
        assert_eq!(library_candidate(Some(d.path().to_str().unwrap())), d.path().join(LIB_NAME));
    }

    #[test]
    fn engine_config_asks_for_non_blocking_tcp_connects() {
        assert_eq!(ucx_engine_config(""), "TCP_CONN_NB=y");
        assert_eq!(ucx_engine_config("RC_FENCE=none,"), "RC_FENCE=none,TCP_CONN_NB=y");
    }

    #[test]
    fn missing_library_error_names_the_install_and_the_variable() {
        let e = TransportError::LibraryNotFound { tried: "/nope/libnixl_capi.so".into(), reason: "no such file".into() };
        let s = e.to_string();
        assert!(s.contains("pip install nixl-cu12") && s.contains(LIB_ENV) && s.contains("/nope/libnixl_capi.so"), "{s}");
    }
}
