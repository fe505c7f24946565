//! What the SSD directory's files are checked and reported with (segment.rs and salt.rs
//! both open files there): whether a file is the pool's own, and the I/O error naming it.

use std::io;
use std::path::Path;

use super::error::SsdError;

pub(crate) fn io_err(path: &Path, what: &str, e: io::Error) -> SsdError {
    SsdError::Io { path: path.to_path_buf(), what: what.to_string(), source: e }
}

pub(crate) fn errno(e: rustix::io::Errno) -> io::Error {
    io::Error::from_raw_os_error(e.raw_os_error())
}

/// Why a file in an SSD directory is not one the pool may use, or None when it may: a
/// regular file, owned by `uid`, with one link (a hard link another user planted could name
/// a file elsewhere that the pool would then write).
pub fn foreign_file(st: &rustix::fs::Stat, uid: u32) -> Option<String> {
    let kind = rustix::fs::FileType::from_raw_mode(st.st_mode);
    if kind != rustix::fs::FileType::RegularFile {
        return Some(format!("is not a regular file ({kind:?})"));
    }
    if st.st_uid != uid {
        return Some(format!("is owned by uid {}, not the pool's uid {uid}", st.st_uid));
    }
    if st.st_nlink != 1 {
        return Some(format!("has {} hard links (a segment has one)", st.st_nlink));
    }
    None
}
