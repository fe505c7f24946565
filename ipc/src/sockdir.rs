//! The directory a pool socket lives in (docs/security.md, "Impersonation"): whoever may
//! rename entries in it may put their own socket in place of the pool's, and engines would
//! hand that process their KV memory. So the pool refuses a directory (or any directory
//! above it) that is owned by another non-root user, or that others may write without the
//! sticky bit, and creates a missing one itself: mode 0750, not through a symlink, with the
//! mode and group set through the opened directory's fd.
//!
//! The same checks guard the SSD tier's directories ([`DirPolicy::SSD`]: whoever may write
//! there may plant segments the pool serves, or links it would write through) and the
//! metrics socket's.

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};

/// Why a socket directory was refused (the message names the directory and the fix), or
/// which step of preparing it failed (with the system error as `source`).
#[derive(Debug)]
pub struct UnsafeDir {
    /// What the directory is for, as messages name it ("socket directory").
    pub what: &'static str,
    pub dir: PathBuf,
    pub message: String,
    /// The system error of the step that failed; None for a refusal by policy.
    pub source: Option<io::Error>,
}

impl std::fmt::Display for UnsafeDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.what, self.dir.display(), self.message)?;
        match &self.source {
            Some(e) => write!(f, ": {e}"),
            None => Ok(()),
        }
    }
}

impl std::error::Error for UnsafeDir {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_ref().map(|e| e as _)
    }
}

/// What a checked directory is for: how refusals name it and the fix, and how a missing
/// one is created.
#[derive(Debug, Clone, Copy)]
pub struct DirPolicy {
    /// How messages name the directory ("socket directory").
    pub what: &'static str,
    /// What its owner could replace or plant (for the message).
    pub holds: &'static str,
    /// The flag that picks another one (for the message).
    pub flag: &'static str,
    /// Mode of a directory the call creates; None: a missing directory is an error.
    pub create_mode: Option<u32>,
}

impl DirPolicy {
    /// A pool's socket directory: created 0750 (group members reach the socket through it).
    pub const SOCKET: DirPolicy = DirPolicy { what: "socket directory", holds: "the socket", flag: "--socket", create_mode: Some(0o750) };
    /// An SSD tier directory: must exist (it names a drive); the pool's segments, lock and
    /// probe live in it.
    pub const SSD: DirPolicy =
        DirPolicy { what: "SSD directory", holds: "segment files the pool would serve", flag: "--ssd-dir", create_mode: None };
    /// A private subdirectory the pool creates in a shared (sticky) SSD directory: 0700.
    pub const SSD_PRIVATE: DirPolicy = DirPolicy { create_mode: Some(0o700), ..Self::SSD };
}

fn refuse(p: &DirPolicy, dir: &Path, message: impl Into<String>) -> UnsafeDir {
    UnsafeDir { what: p.what, dir: dir.to_path_buf(), message: message.into(), source: None }
}

/// Step `what` on `dir` failed with `e`.
fn failed(p: &DirPolicy, dir: &Path, what: impl Into<String>, e: impl Into<io::Error>) -> UnsafeDir {
    UnsafeDir { what: p.what, dir: dir.to_path_buf(), message: what.into(), source: Some(e.into()) }
}

const STICKY: u32 = 0o1000;

/// Checks one directory's owner and mode: owned by `me` or root; not writable by group or
/// others unless sticky.
fn check_one(p: &DirPolicy, dir: &Path, uid: u32, mode: u32, me: u32) -> Result<(), UnsafeDir> {
    let DirPolicy { holds, flag, .. } = *p;
    if uid != me && uid != 0 {
        let fix = if p.create_mode.is_some() { "remove it and let the pool create it, or " } else { "" };
        return Err(refuse(
            p,
            dir,
            format!(
                "owned by uid {uid}, neither this process's uid {me} nor root: its owner could replace {holds}; \
                 use a directory of your own (e.g. {fix}pick another {flag})"
            ),
        ));
    }
    if mode & 0o022 != 0 && mode & STICKY == 0 {
        return Err(refuse(
            p,
            dir,
            format!(
                "mode {:04o} lets other users rename or replace {holds} (writable by group or others without the \
                 sticky bit); chmod go-w it or pick another {flag}",
                mode & 0o7777
            ),
        ));
    }
    Ok(())
}

/// Whether a directory of this mode lets users other than its owner create entries in it
/// (group or others may write; with the sticky bit they still may add new names).
pub fn others_may_create(mode: u32) -> bool {
    mode & 0o022 != 0
}

/// Makes `dir` a safe home for a socket: creates it (0750, group `group` when given) if it
/// is missing, then checks it and every directory above it. Returns whether it created it.
pub fn prepare_socket_dir(dir: &Path, group: Option<u32>) -> Result<bool, UnsafeDir> {
    prepare_dir(dir, &DirPolicy::SOCKET, group).map(|(_, created, _)| created)
}

/// Makes `dir` a safe directory for `policy`: creates it if it is missing and the policy
/// says how (group `group` when given), opens it `O_NOFOLLOW`, then checks it and every
/// directory above it. Returns the open directory (open files in it relative to this fd, so
/// a rename of a directory above cannot redirect them), whether it created it, and its mode.
pub fn prepare_dir(dir: &Path, policy: &DirPolicy, group: Option<u32>) -> Result<(OwnedFd, bool, u32), UnsafeDir> {
    let p = policy;
    let me = rustix::process::geteuid().as_raw();
    let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
    let created = match p.create_mode {
        Some(_) => {
            if let Some(parent) = dir.parent().filter(|d| !d.as_os_str().is_empty()) {
                if std::fs::symlink_metadata(parent).is_err() {
                    std::fs::create_dir_all(parent).map_err(|e| failed(p, parent, "cannot create it", e))?;
                }
            }
            // mkdir never follows a symlink at the last component (it fails with EEXIST), and
            // the O_NOFOLLOW open below refuses one, so an attacker's link is never used.
            match rustix::fs::mkdir(dir, Mode::from_raw_mode(0o700)) {
                Ok(()) => true,
                Err(rustix::io::Errno::EXIST) => false,
                Err(e) => return Err(failed(p, dir, "cannot create it", e)),
            }
        }
        None => false,
    };
    let fd = rustix::fs::open(dir, OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty()).map_err(
        |e| match e {
            rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR => {
                refuse(p, dir, "is a symbolic link or not a directory; give the real directory")
            }
            e => failed(p, dir, "cannot open it", e),
        },
    )?;
    if created {
        if let Some(gid) = group {
            rustix::fs::fchown(&fd, None, Some(rustix::fs::Gid::from_raw(gid)))
                .map_err(|e| failed(p, dir, format!("cannot give it to group {gid}"), e))?;
        }
        // Socket: group members reach the socket through it (the socket itself is 0660).
        let mode = p.create_mode.expect("created only with a mode");
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode)).map_err(|e| failed(p, dir, "cannot set its mode", e))?;
    }
    let st = rustix::fs::fstat(&fd).map_err(|e| failed(p, dir, "fstat", e))?;
    check_one(p, dir, st.st_uid, st.st_mode, me)?;
    // Every directory above: whoever may rename one of them may swap the whole subtree.
    let canon = std::fs::canonicalize(dir).map_err(|e| failed(p, dir, "cannot resolve it", e))?;
    for up in canon.ancestors().skip(1) {
        let m = std::fs::symlink_metadata(up).map_err(|e| failed(p, up, "stat", e))?;
        check_one(p, up, m.uid(), m.mode(), me)
            .map_err(|e| refuse(p, dir, format!("the directory above it, {}: {}", up.display(), e.message)))?;
    }
    Ok((fd, created, st.st_mode))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("umbp-sockdir-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        d
    }

    #[test]
    fn creates_a_private_directory() {
        let base = scratch("create");
        let dir = base.join("umbp");
        assert!(prepare_socket_dir(&dir, None).unwrap());
        assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o7777, 0o750);
        assert!(!prepare_socket_dir(&dir, None).unwrap(), "second call reuses it");
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn refuses_world_writable_and_symlinks() {
        let base = scratch("refuse");
        let open = base.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = prepare_socket_dir(&open, None).unwrap_err().to_string();
        assert!(e.contains(&open.display().to_string()) && e.contains("0777"), "{e}");
        // Sticky is fine (/tmp itself).
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
        prepare_socket_dir(&open, None).unwrap();
        let link = base.join("link");
        std::os::unix::fs::symlink(&open, &link).unwrap();
        let e = prepare_socket_dir(&link, None).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        // Below a world-writable, non-sticky directory: refused, naming that one.
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = prepare_socket_dir(&open.join("umbp"), None).unwrap_err().to_string();
        assert!(e.contains("directory above it"), "{e}");
        let refusal = prepare_socket_dir(&open.join("umbp"), None).unwrap_err();
        assert!(std::error::Error::source(&refusal).is_none(), "a refusal by policy has no system error: {refusal}");
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn a_failed_step_keeps_its_system_error() {
        let base = scratch("failed");
        let file = base.join("file");
        std::fs::write(&file, b"").unwrap();
        let e = prepare_socket_dir(&file.join("umbp"), None).unwrap_err();
        assert_eq!(e.source.as_ref().and_then(|s| s.raw_os_error()), Some(libc::ENOTDIR), "{e}");
        assert!(std::error::Error::source(&e).is_some());
        assert_eq!(
            e.to_string(),
            format!("socket directory {}: cannot create it: {}", file.join("umbp").display(), e.source.as_ref().unwrap())
        );
        std::fs::remove_dir_all(&base).unwrap();
    }
}
