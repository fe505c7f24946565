//! Who is at the other end of a unix socket, and whether it still is (docs/security.md,
//! "Memory that is not the peer's" and "Impersonation").
//!
//! - [`peer_cred`]: `SO_PEERCRED` read without trusting the pid to be non-zero (a peer in a
//!   pid namespace the reader cannot see reports pid 0).
//! - [`PeerProcess`]: the pool's hold on the process that connected: a pidfd taken at
//!   accept (`SO_PEERPIDFD` where the kernel has it, else `pidfd_open` at once plus the
//!   process start time), and [`PeerProcess::verify`], which checks before each use of the
//!   pid that it still names that process and that the process still runs as the peer's uid
//!   (not setuid, not made non-dumpable).
//! - [`check_pool_peer`]: the client side: the process listening on the pool socket must
//!   run as the client's uid, root, or a uid the client was configured to trust.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// `SO_PEERPIDFD` (Linux 6.5); not in every libc crate yet.
const SO_PEERPIDFD: libc::c_int = 77;

/// Environment variable naming a uid (besides the client's own and root) that a worker or
/// scheduler accepts as the pool's.
pub const POOL_UID_ENV: &str = "UMBP_POOL_UID";

/// Credentials of a unix-socket peer as of its `connect`/`socketpair`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCred {
    /// 0 when the peer's pid is not visible in this process's pid namespace.
    pub pid: u32,
    pub uid: u32,
    pub gid: u32,
}

/// `SO_PEERCRED` of `sock`.
pub fn peer_cred(sock: BorrowedFd<'_>) -> io::Result<PeerCred> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is a writable ucred and `len` its size; the kernel writes at most len.
    let rc = unsafe {
        libc::getsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&mut cred as *mut libc::ucred).cast(), &mut len)
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // A negative pid never comes from the kernel; treat it as "not visible" too.
    Ok(PeerCred { pid: u32::try_from(cred.pid).unwrap_or(0), uid: cred.uid, gid: cred.gid })
}

/// `SO_PEERPIDFD` of `sock`: a pidfd of the process that connected, taken by the kernel at
/// connect time (so immune to pid reuse). None where the kernel lacks it.
fn peer_pidfd(sock: BorrowedFd<'_>) -> Option<OwnedFd> {
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `fd` is a writable int and `len` its size.
    let rc = unsafe { libc::getsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, SO_PEERPIDFD, (&mut fd as *mut libc::c_int).cast(), &mut len) };
    // SAFETY: on success the kernel installed a new fd that we now own.
    (rc == 0 && fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
}

/// How [`PeerProcess`] got its pidfd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PidfdSource {
    /// `SO_PEERPIDFD`: the very process that connected.
    SoPeerPidfd,
    /// `pidfd_open` of the `SO_PEERCRED` pid at accept, plus its start time.
    PidfdOpen,
    /// None: the pid is not visible here (another pid namespace) or it was gone at accept.
    None,
}

/// The process that connected to a socket, held by a pidfd from accept on.
#[derive(Debug)]
pub struct PeerProcess {
    pub cred: PeerCred,
    pidfd: Option<OwnedFd>,
    /// Field 22 of `/proc/<pid>/stat` when the pidfd was taken.
    start_time: Option<u64>,
    pub source: PidfdSource,
}

fn gone(pid: u32) -> String {
    format!("process {pid} that connected has exited")
}

impl PeerProcess {
    /// Captures the peer of `sock`. Call it as soon as the connection is accepted.
    pub fn capture(sock: BorrowedFd<'_>) -> io::Result<Self> {
        Self::capture_with(sock, true)
    }

    /// [`Self::capture`]; with `so_peerpidfd` false it takes the fallback path (`pidfd_open`
    /// of the `SO_PEERCRED` pid plus its start time) even where the kernel has
    /// `SO_PEERPIDFD`, as on kernels before 6.5 (tests of that path).
    pub fn capture_with(sock: BorrowedFd<'_>, so_peerpidfd: bool) -> io::Result<Self> {
        let cred = peer_cred(sock)?;
        if cred.pid == 0 {
            return Ok(Self { cred, pidfd: None, start_time: None, source: PidfdSource::None });
        }
        let (pidfd, source) = match so_peerpidfd.then(|| peer_pidfd(sock)).flatten() {
            Some(fd) => (Some(fd), PidfdSource::SoPeerPidfd),
            None => {
                let pid = rustix::process::Pid::from_raw(cred.pid as i32);
                match pid.map(|p| rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty())) {
                    Some(Ok(fd)) => (Some(fd), PidfdSource::PidfdOpen),
                    _ => (None, PidfdSource::None),
                }
            }
        };
        let start_time = pidfd.as_ref().and_then(|_| start_time(cred.pid).ok());
        Ok(Self { cred, pidfd, start_time, source })
    }

    /// The peer's pid in this pid namespace, if it has one here.
    pub fn pid(&self) -> Option<u32> {
        (self.cred.pid != 0).then_some(self.cred.pid)
    }

    pub fn pidfd(&self) -> Option<BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        self.pidfd.as_ref().map(|f| f.as_fd())
    }

    /// Checks that the pid still names the process that connected, and that this process
    /// still runs as the peer's uid: real, effective, saved and filesystem uid all equal to
    /// it, and dumpable (a setuid/setgid exec or `PR_SET_DUMPABLE 0` makes `/proc/<pid>` owned
    /// by root). Peers that connected as root pass the uid checks (root may read anything).
    /// The error says what changed.
    pub fn verify(&self) -> Result<(), String> {
        let pid = self
            .pid()
            .ok_or_else(|| "peer is in another pid namespace (SO_PEERCRED pid 0): its process memory is out of reach".to_string())?;
        let pidfd = self.pidfd().ok_or_else(|| gone(pid))?;
        let uid = self.cred.uid;
        if uid != 0 {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|_| gone(pid))?;
            let uids: Vec<u32> = status
                .lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .map(|l| l.split_whitespace().filter_map(|u| u.parse().ok()).collect())
                .unwrap_or_default();
            if uids.len() != 4 || uids.iter().any(|u| *u != uid) {
                return Err(format!("process {pid} runs as uids {uids:?}, not {uid} alone: setuid exec since connect"));
            }
            let owner = rustix::fs::stat(format!("/proc/{pid}").as_str()).map_err(|_| gone(pid))?.st_uid;
            if owner != uid {
                return Err(format!("process {pid} is not dumpable by uid {uid} (/proc/{pid} owner {owner}): setuid exec since connect"));
            }
        }
        if let Some(t) = self.start_time {
            if start_time(pid).map_err(|_| gone(pid))? != t {
                return Err(format!("pid {pid} now names another process (start time changed)"));
            }
        }
        // Last: the pidfd says the process did not exit (and so its pid was not reused)
        // while the files above were read, and that it still has this pid.
        if pidfd_exited(pidfd) || pidfd_pid(pidfd) != Some(pid) {
            return Err(gone(pid));
        }
        Ok(())
    }
}

/// Whether the process of `pidfd` has exited (the pidfd polls readable, or the pidfd is
/// not one: HUP/ERR/NVAL). A signal interrupting the poll (EINTR) is no verdict: the poll
/// is made again. Any other failure of the poll itself (ENOMEM) is not taken as an exit
/// either: calling a live process dead would release memory it may still write.
pub fn pidfd_exited(pidfd: BorrowedFd<'_>) -> bool {
    let mut fds = [rustix::event::PollFd::new(&pidfd, rustix::event::PollFlags::IN)];
    let zero = rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 };
    loop {
        match rustix::event::poll(&mut fds, Some(&zero)) {
            Err(rustix::io::Errno::INTR) => continue,
            Ok(n) => return n > 0,
            Err(_) => return false,
        }
    }
}

/// The pid of `pidfd`'s process in this pid namespace (its fdinfo `Pid:`), None if exited.
fn pidfd_pid(pidfd: BorrowedFd<'_>) -> Option<u32> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", pidfd.as_raw_fd())).ok()?;
    let pid: i64 = info.lines().find_map(|l| l.strip_prefix("Pid:"))?.trim().parse().ok()?;
    u32::try_from(pid).ok().filter(|p| *p != 0)
}

/// Field 22 (starttime, clock ticks after boot) of `/proc/<pid>/stat`.
pub fn start_time(pid: u32) -> io::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Field 2 (comm) may hold spaces and parentheses: count from the last ')'.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).ok_or_else(|| io::Error::other("malformed stat"))?;
    // rest starts at field 3; field 22 is the 20th from there.
    rest.split_whitespace()
        .nth(19)
        .and_then(|f| f.parse().ok())
        .ok_or_else(|| io::Error::other(format!("/proc/{pid}/stat has no start time")))
}

/// The uid this process accepts as the pool's besides its own and root: `configured`, else
/// `UMBP_POOL_UID`. A malformed variable is an error naming it.
pub fn trusted_pool_uid(configured: Option<u32>) -> Result<Option<u32>, String> {
    if configured.is_some() {
        return Ok(configured);
    }
    match std::env::var(POOL_UID_ENV) {
        Ok(v) if !v.trim().is_empty() => v.trim().parse().map(Some).map_err(|_| format!("{POOL_UID_ENV}={v:?} is not a uid (a number)")),
        _ => Ok(None),
    }
}

/// Client side, before sending anything: the process that listens on the pool socket must
/// run as this process's effective uid, root, or `pool_uid` (else `UMBP_POOL_UID`).
/// Returns the pool's credentials (its pid is the pool's verified pid).
pub fn check_pool_peer(sock: BorrowedFd<'_>, pool_uid: Option<u32>) -> Result<PeerCred, String> {
    let cred = peer_cred(sock).map_err(|e| format!("SO_PEERCRED of the pool socket: {e}"))?;
    let me = rustix::process::geteuid().as_raw();
    let extra = trusted_pool_uid(pool_uid)?;
    if cred.uid == me || cred.uid == 0 || Some(cred.uid) == extra {
        return Ok(cred);
    }
    Err(format!(
        "the process listening on the pool socket runs as uid {} (pid {}), which is neither this process's uid {me} \
         nor root{}; refusing to talk to it (set {POOL_UID_ENV}={} or the connector option pool_uid if that is the \
         pool's service user)",
        cred.uid,
        cred.pid,
        extra.map(|u| format!(" or the configured pool uid {u}")).unwrap_or_default(),
        cred.uid
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn own_process_verifies_and_start_time_parses() {
        let (a, _b) = UnixStream::pair().unwrap();
        let p = PeerProcess::capture(a.as_fd()).unwrap();
        assert_eq!(p.pid(), Some(std::process::id()));
        assert_ne!(p.source, PidfdSource::None);
        p.verify().unwrap();
        assert!(start_time(std::process::id()).unwrap() > 0);
    }

    #[test]
    fn pid_zero_is_refused_not_trusted() {
        let p = PeerProcess { cred: PeerCred { pid: 0, uid: 1000, gid: 1000 }, pidfd: None, start_time: None, source: PidfdSource::None };
        let e = p.verify().unwrap_err();
        assert!(e.contains("pid namespace"), "{e}");
    }

    #[test]
    fn own_uid_pool_is_trusted() {
        let (a, _b) = UnixStream::pair().unwrap();
        let c = check_pool_peer(a.as_fd(), None).unwrap();
        assert_eq!(c.pid, std::process::id());
    }
}
