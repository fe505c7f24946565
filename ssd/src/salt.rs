//! The directory's secret salt file (`.umbp-ssd.salt`, format 2; issue #34, S4): read at
//! open, created with the directory's first segment-free open (0600, `O_EXCL`, never
//! through a symlink), refused with a clear error where it is not the pool's own private
//! file. Segments found without one (a directory of format 1) are removed by the opener
//! (segment.rs) before the salt is created.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::path::Path;

use rustix::fs::{Mode, OFlags};

use super::dir_files::{errno, foreign_file, io_err};
use super::error::SsdError;
use super::format::{Salt, SALT_FILE_BYTES};

/// Name of the salt file in an SSD directory.
pub const SALT_NAME: &str = ".umbp-ssd.salt";

/// The salt of the directory open as `fd` (at `dir`, locked by the caller), which holds
/// `segments` segment files. Creates one where there is none and no segment either (or
/// only a salt file cut short by a crash at its creation, with no segment written under it).
pub fn load_or_create(fd: &OwnedFd, dir: &Path, uid: u32, segments: usize) -> Result<Salt, SsdError> {
    let path = dir.join(SALT_NAME);
    // NONBLOCK: a FIFO planted under the name must not hang the open.
    match rustix::fs::openat(fd, SALT_NAME, OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC, Mode::empty()) {
        Ok(f) => {
            let st = rustix::fs::fstat(&f).map_err(|e| io_err(&path, "fstat", errno(e)))?;
            if let Some(why) = foreign_file(&st, uid) {
                return Err(SsdError::Unsafe { path, message: format!("{why}: refusing to use it as the directory's salt") });
            }
            if st.st_mode & 0o077 != 0 {
                return Err(SsdError::Unsafe {
                    path,
                    message: format!(
                        "mode {:04o} lets others read the secret that authenticates the segments' records: refusing it (remove it and the seg-*.umbp files beside it)",
                        st.st_mode & 0o7777
                    ),
                });
            }
            let mut b = Vec::with_capacity(SALT_FILE_BYTES + 1);
            std::fs::File::from(f).take(SALT_FILE_BYTES as u64 + 1).read_to_end(&mut b).map_err(|e| io_err(&path, "reading", e))?;
            if let Some(salt) = Salt::from_file_bytes(&b) {
                return Ok(salt);
            }
            if segments > 0 {
                return Err(SsdError::Unsafe {
                    path,
                    message: format!(
                        "is not a salt file of SSD format 2 ({} bytes): the {segments} segment file(s) beside it cannot be checked; remove it and the seg-*.umbp files (their objects are lost: the tier is a cache)",
                        b.len()
                    ),
                });
            }
            // Cut short by a crash while it was created: nothing was written under it.
            tracing::warn!(path = %path.display(), bytes = b.len(), "SSD salt file incomplete and no segment beside it: creating it again");
            rustix::fs::unlinkat(fd, SALT_NAME, rustix::fs::AtFlags::empty()).map_err(|e| io_err(&path, "removing", errno(e)))?;
            create(fd, dir, &path)
        }
        // The opener removed the segments of a directory without a salt (segment.rs); one
        // still counted here appeared meanwhile: never make up a salt for it.
        Err(rustix::io::Errno::NOENT) if segments > 0 => Err(SsdError::OldFormat { path: dir.to_path_buf(), segments }),
        Err(rustix::io::Errno::NOENT) => create(fd, dir, &path),
        Err(rustix::io::Errno::LOOP) => {
            Err(SsdError::Unsafe { path, message: "is a symbolic link: refusing to follow it (remove it)".into() })
        }
        Err(e) => Err(io_err(&path, "opening", errno(e))),
    }
}

/// Whether the directory open as `fd` has no salt file (nothing under the name, not even
/// a link: a link or another file there is judged by `load_or_create`).
pub fn missing(fd: &OwnedFd) -> Result<bool, SsdError> {
    match rustix::fs::statat(fd, SALT_NAME, rustix::fs::AtFlags::SYMLINK_NOFOLLOW) {
        Ok(_) => Ok(false),
        Err(rustix::io::Errno::NOENT) => Ok(true),
        Err(e) => Err(io_err(Path::new(SALT_NAME), "stat", errno(e))),
    }
}

fn create(fd: &OwnedFd, dir: &Path, path: &Path) -> Result<Salt, SsdError> {
    let mut secret = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut secret))
        .map_err(|e| io_err(Path::new("/dev/urandom"), "reading", e))?;
    let salt = Salt::new(secret);
    let f = rustix::fs::openat(
        fd,
        SALT_NAME,
        OFlags::CREATE | OFlags::EXCL | OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .map_err(|e| io_err(path, "creating", errno(e)))?;
    let mut f = std::fs::File::from(f);
    f.write_all(&salt.file_bytes()).map_err(|e| io_err(path, "writing", e))?;
    f.sync_all().map_err(|e| io_err(path, "fsync", e))?;
    rustix::fs::fsync(fd).map_err(|e| io_err(dir, "fsync SSD directory", errno(e)))?;
    Ok(salt)
}
