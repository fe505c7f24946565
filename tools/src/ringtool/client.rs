//! An observer attachment: connects to a pool's socket as `Role::Observer`, maps the index
//! and the event log read-only, and asks for the pool's JSON state report. An observer has
//! no SQ traffic and registers nothing, so it never disturbs workers or schedulers.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use umbp_ipc::message::{recv_message, send_message};
use umbp_ipc::SharedMemory;
use umbp_pool::Report;
use umbp_protocol::events::{EventLog, EventLogSnapshot};
use umbp_protocol::index::{IndexSnapshot, IndexView, TABLES_OFFSET};
use umbp_protocol::wire::{self, Hello, HelloReply, MessageKind, Reply, Role};

const TIMEOUT: Duration = Duration::from_secs(5);

/// The socket ringtool uses when `--socket` is not given: like `umbp-pool`,
/// `UMBP_STANDALONE_ADDRESS` (a path or `unix://` address), else the default path.
pub fn default_socket() -> Result<PathBuf, String> {
    umbp_ipc::endpoint::default_endpoint().map_err(|e| e.to_string())
}

pub struct Observer {
    socket: PathBuf,
    sock: UnixStream,
    pub reply: HelloReply,
    index: Option<SharedMemory>,
    events: Option<SharedMemory>,
}

impl Observer {
    /// Attaches; every error names the socket.
    pub fn attach(socket: &Path) -> Result<Self, String> {
        let at = |what: &str, e: &dyn std::fmt::Display| format!("pool at {}: {what}: {e}", socket.display());
        let sock = UnixStream::connect(socket).map_err(|e| {
            format!(
                "cannot connect to the pool at {}: {e} (is umbp-pool running? choose its socket with --socket or UMBP_STANDALONE_ADDRESS)",
                socket.display()
            )
        })?;
        // As workers do: only a pool of our uid, root or UMBP_POOL_UID hears our Hello (a socket
        // another user put in place of the pool's learns nothing, docs/security.md item 4).
        umbp_ipc::peer::check_pool_peer(std::os::fd::AsFd::as_fd(&sock), None).map_err(|e| format!("pool at {}: {e}", socket.display()))?;
        let mut hello = Hello::new(Role::Observer, 0, std::process::id());
        // An observer submits nothing: ask for the smallest rings and arena the pool allows.
        hello.sq_entries = 1;
        hello.arena_bytes = 4096;
        send_message(&sock, MessageKind::Hello, bytemuck::bytes_of(&hello), &[], Some(TIMEOUT)).map_err(|e| at("sending Hello", &e))?;
        let m = recv_message(&sock, Some(TIMEOUT)).map_err(|e| at("waiting for HelloReply", &e))?;
        if m.kind != MessageKind::HelloReply {
            return Err(at("unexpected answer", &format!("{:?}", m.kind)));
        }
        let reply: HelloReply = wire::decode(&m.payload).map_err(|e| at("bad HelloReply", &e))?;
        if reply.status != 0 {
            return Err(format!("refused by the pool at {}: {}", socket.display(), reply.message()));
        }
        // fds: ring memfd (unused: observers submit nothing), index, doorbell, event log.
        let mut fds = m.fds.into_iter();
        let _ring = fds.next();
        let index = fds.next().and_then(|fd| SharedMemory::from_received(fd, TABLES_OFFSET, false).ok());
        let _doorbell = fds.next();
        let events = fds.next().and_then(|fd| SharedMemory::from_received(fd, umbp_protocol::events::EVENT_ENTRIES_OFFSET, false).ok());
        Ok(Self { socket: socket.to_path_buf(), sock, reply, index, events })
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The pool's state report (what `StatsRequest` returns): the full one, or the tenant
    /// view when ringtool runs as another user than the pool (and not as root).
    pub fn stats(&self) -> Result<Report, String> {
        let at = |what: &str, e: &dyn std::fmt::Display| format!("pool at {}: {what}: {e}", self.socket.display());
        send_message(&self.sock, MessageKind::StatsRequest, &[], &[], Some(TIMEOUT)).map_err(|e| at("StatsRequest", &e))?;
        let m = recv_message(&self.sock, Some(TIMEOUT)).map_err(|e| at("waiting for the report", &e))?;
        let r: Reply = wire::decode(&m.payload).map_err(|e| at("bad Reply", &e))?;
        if r.status != 0 {
            return Err(at("StatsRequest refused", &r.message()));
        }
        let json = &m.payload[std::mem::size_of::<Reply>()..];
        serde_json::from_slice(json).map_err(|e| at("report is not a pool report of this version", &e))
    }

    /// Index statistics read directly from the shared mapping.
    pub fn index_snapshot(&self) -> Option<IndexSnapshot> {
        let m = self.index.as_ref()?;
        // SAFETY: a read-only mapping that lives as long as `self`; attach checks the header.
        unsafe { IndexView::attach(m.as_ptr(), m.len()) }.ok().map(|v| v.snapshot())
    }

    /// Event log header read directly from the shared mapping.
    pub fn events_snapshot(&self) -> Option<EventLogSnapshot> {
        let m = self.events.as_ref()?;
        // SAFETY: as above.
        unsafe { EventLog::attach(m.as_ptr(), m.len()) }.ok().map(|l| l.snapshot())
    }
}
