//! Segment files and the directories that hold them: naming, opening with O_DIRECT (or
//! buffered, with one warning, where the file system refuses it), the directory checks
//! (owner, mode, no symlinks, only the pool's own files) and lock, and block-aligned buffers.

use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};

use super::dir_files::{errno, foreign_file, io_err};
use super::error::SsdError;
use super::format::{self, FooterEntry, Salt, BLOCK};

/// A zeroed heap buffer aligned to [`BLOCK`], as O_DIRECT needs.
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only reads through &self.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    pub fn new(len: usize) -> Self {
        let len = len.max(BLOCK as usize).next_multiple_of(BLOCK as usize);
        let layout = std::alloc::Layout::from_size_align(len, BLOCK as usize).expect("aligned layout");
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self { ptr, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised (zeroed) bytes for our lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and &mut self makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::from_size_align(self.len, BLOCK as usize).expect("aligned layout");
        // SAFETY: allocated in new() with this same layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
    }
}

pub fn segment_name(id: u64) -> String {
    format!("seg-{id:016x}.umbp")
}

/// The segment files in `dir`, in segment order (tests and tools that inspect a directory).
pub fn segment_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut v: Vec<(u64, PathBuf)> = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let path = e?.path();
        if let Some(id) = path.file_name().and_then(|n| n.to_str()).and_then(parse_segment_name) {
            v.push((id, path));
        }
    }
    v.sort();
    Ok(v.into_iter().map(|(_, p)| p).collect())
}

pub fn parse_segment_name(name: &str) -> Option<u64> {
    let hex = name.strip_prefix("seg-")?.strip_suffix(".umbp")?;
    if hex.len() != 16 {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

/// One SSD directory (one drive), checked and locked against a second pool. Every file in
/// it is opened relative to the directory's fd with `O_NOFOLLOW` (docs/security.md, "The SSD
/// directory").
pub struct Directory {
    /// Where the segments are: the directory given, or the pool's private subdirectory of
    /// it when others may create files in the one given (a sticky shared directory).
    pub path: PathBuf,
    /// Whether files here are opened with O_DIRECT.
    pub direct: bool,
    /// The directory itself, opened `O_NOFOLLOW` and checked.
    fd: OwnedFd,
    /// The pool's effective uid: every file it opens here must be its own.
    uid: u32,
    /// The key of this directory's record and trailer tags (`salt`).
    pub salt: Salt,
    /// Holds the flock on `.umbp-ssd.lock` for the directory's lifetime.
    _lock: File,
}

/// Name of the lock file in an SSD directory.
pub const LOCK_NAME: &str = ".umbp-ssd.lock";

/// The private subdirectory a pool of uid `uid` uses inside a shared (sticky) directory.
pub fn private_subdir_name(uid: u32) -> String {
    format!("umbp-ssd-{uid}")
}

/// Ids of the segment files in the directory open as `fd`, ascending.
fn segment_ids(fd: &OwnedFd, path: &Path) -> Result<Vec<u64>, SsdError> {
    let mut rd = rustix::fs::Dir::read_from(fd).map_err(|e| io_err(path, "listing SSD directory", errno(e)))?;
    let mut ids = Vec::new();
    while let Some(ent) = rd.read() {
        let ent = ent.map_err(|e| io_err(path, "listing SSD directory", errno(e)))?;
        if let Some(id) = ent.file_name().to_str().ok().and_then(parse_segment_name) {
            ids.push(id);
        }
    }
    ids.sort_unstable();
    Ok(ids)
}

impl Directory {
    /// Checks `path` as the socket directory is checked (owner, mode, every directory above:
    /// `umbp_ipc::sockdir`), moves into a private 0700 subdirectory when others may create
    /// files in it (sticky), locks it, and (with `try_direct`) probes O_DIRECT.
    pub fn open(path: &Path, try_direct: bool) -> Result<Self, SsdError> {
        use umbp_ipc::sockdir::{others_may_create, prepare_dir, DirPolicy};
        let uid = rustix::process::geteuid().as_raw();
        let (mut fd, _, mode) = prepare_dir(path, &DirPolicy::SSD, None)?;
        let mut path = path.to_path_buf();
        if others_may_create(mode) {
            // Sticky and writable by others (as /var/tmp): they may not rename our files,
            // but they may add any name, so the segments live one level down, 0700.
            let sub = path.join(private_subdir_name(uid));
            let (sub_fd, created, _) = prepare_dir(&sub, &DirPolicy::SSD_PRIVATE, None)?;
            if created {
                tracing::info!(dir = %path.display(), private = %sub.display(), "SSD directory is shared (sticky, writable by others): using a private 0700 subdirectory");
            }
            fd = sub_fd;
            path = sub;
        }
        let lock_path = path.join(LOCK_NAME);
        let lock = rustix::fs::openat(
            &fd,
            LOCK_NAME,
            OFlags::CREATE | OFlags::RDWR | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| match e {
            rustix::io::Errno::LOOP => {
                SsdError::Unsafe { path: lock_path.clone(), message: "is a symbolic link: refusing to follow it (remove it)".into() }
            }
            e => io_err(&path, &format!("SSD directory is not writable (creating {LOCK_NAME})"), errno(e)),
        })?;
        let st = rustix::fs::fstat(&lock).map_err(|e| io_err(&lock_path, "fstat", errno(e)))?;
        if let Some(why) = foreign_file(&st, uid) {
            return Err(SsdError::Unsafe { path: lock_path, message: format!("{why}: refusing to use it (remove it)") });
        }
        let lock = File::from(lock);
        // A read-only bind mount or a directory without write permission for us fails
        // above; a root-owned process passes permission checks, so probe a real write too.
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive)
            .map_err(|e| SsdError::Locked { path: path.clone(), source: errno(e) })?;
        // Segment names that are the pool's own files (links and others' files are refused
        // later, one by one, and do not make this a directory of format 1).
        let own: Vec<u64> = segment_ids(&fd, &path)?
            .into_iter()
            .filter(|&id| {
                rustix::fs::statat(&fd, segment_name(id).as_str(), rustix::fs::AtFlags::SYMLINK_NOFOLLOW)
                    .is_ok_and(|st| foreign_file(&st, uid).is_none())
            })
            .collect();
        let mut segments = own.len();
        if segments > 0 && super::salt::missing(&fd)? {
            // Format 1 (an upgrade), or a salt file removed: no record there can be told
            // from a forged one, so none is served. The tier is a cache: its segments go,
            // and the pool starts with an empty tier instead of refusing to start.
            for &id in &own {
                let name = segment_name(id);
                rustix::fs::unlinkat(&fd, name.as_str(), rustix::fs::AtFlags::empty())
                    .map_err(|e| io_err(&path.join(&name), "removing an unauthenticated segment", errno(e)))?;
            }
            rustix::fs::fsync(&fd).map_err(|e| io_err(&path, "fsync SSD directory", errno(e)))?;
            tracing::warn!(
                dir = %path.display(),
                segments,
                "SSD directory held segment files without a salt file (SSD format 1, or the salt was removed): \
                 their records cannot be authenticated, so they were removed; the SSD tier starts empty and refills"
            );
            segments = 0;
        }
        let salt = super::salt::load_or_create(&fd, &path, uid, segments)?;
        if !try_direct {
            return Ok(Self { path, direct: false, fd, uid, salt, _lock: lock });
        }
        // A name nobody can have planted: O_EXCL never opens an existing file or link.
        static PROBES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        // Relaxed: the counter only makes names unique, it orders nothing.
        let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let probe = format!(".umbp-ssd.probe.{}.{n}.{nanos}", std::process::id());
        let opened = rustix::fs::openat(
            &fd,
            probe.as_str(),
            OFlags::CREATE | OFlags::EXCL | OFlags::RDWR | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::DIRECT,
            Mode::from_raw_mode(0o600),
        );
        let direct = match opened {
            Ok(f) => {
                let f = File::from(f);
                let buf = AlignedBuf::new(BLOCK as usize);
                match f.write_at(&buf, 0) {
                    Ok(_) => Ok(true),
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
                    Err(e) => Err(io_err(&path, "SSD directory refused a test write", e)),
                }
            }
            Err(rustix::io::Errno::INVAL) => Ok(false),
            Err(e) => Err(io_err(&path, "SSD directory is not writable", errno(e))),
        };
        // The probe may exist even where the open failed (O_DIRECT is refused after create).
        let _ = rustix::fs::unlinkat(&fd, probe.as_str(), rustix::fs::AtFlags::empty());
        let direct = direct?;
        if !direct {
            tracing::warn!(
                dir = %path.display(),
                "SSD directory does not support O_DIRECT (tmpfs?): using buffered I/O; reads may be served from the page cache and throughput figures are not the drive's"
            );
        }
        Ok(Self { path, direct, fd, uid, salt, _lock: lock })
    }

    /// Segment ids present, ascending.
    pub fn list_segments(&self) -> Result<Vec<u64>, SsdError> {
        segment_ids(&self.fd, &self.path)
    }

    pub fn segment_path(&self, id: u64) -> PathBuf {
        self.path.join(segment_name(id))
    }

    fn flags(&self) -> OFlags {
        let mut f = OFlags::RDWR | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        if self.direct {
            f |= OFlags::DIRECT;
        }
        f
    }

    pub fn create_segment(&self, id: u64) -> Result<Segment, SsdError> {
        let path = self.segment_path(id);
        let fd = rustix::fs::openat(
            &self.fd,
            segment_name(id).as_str(),
            self.flags() | OFlags::CREATE | OFlags::EXCL,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| io_err(&path, "creating segment", errno(e)))?;
        Ok(Segment { id, path, file: File::from(fd) })
    }

    /// Opens an existing segment: never through a symlink, and only a regular file of the
    /// pool's own uid with one link ([`SsdError::Unsafe`] otherwise: the caller skips it).
    /// fsyncs the directory itself: segment files created or removed since are then
    /// durable (their names), as their data is after `Segment::sync`.
    pub fn sync(&self) -> Result<(), SsdError> {
        rustix::fs::fsync(&self.fd).map_err(|e| io_err(&self.path, "fsync SSD directory", errno(e)))
    }

    pub fn open_segment(&self, id: u64) -> Result<Segment, SsdError> {
        let path = self.segment_path(id);
        // NONBLOCK: a FIFO planted under a segment's name must not hang the open.
        let fd =
            rustix::fs::openat(&self.fd, segment_name(id).as_str(), self.flags() | OFlags::NONBLOCK, Mode::empty()).map_err(
                |e| match e {
                    rustix::io::Errno::LOOP => {
                        SsdError::Unsafe { path: path.clone(), message: "is a symbolic link: not followed, segment skipped".into() }
                    }
                    e => io_err(&path, "opening segment", errno(e)),
                },
            )?;
        let st = rustix::fs::fstat(&fd).map_err(|e| io_err(&path, "fstat segment", errno(e)))?;
        if let Some(why) = foreign_file(&st, self.uid) {
            return Err(SsdError::Unsafe { path, message: format!("{why}: segment skipped") });
        }
        let fl = rustix::fs::fcntl_getfl(&fd).map_err(|e| io_err(&path, "fcntl segment", errno(e)))?;
        rustix::fs::fcntl_setfl(&fd, fl - OFlags::NONBLOCK).map_err(|e| io_err(&path, "fcntl segment", errno(e)))?;
        Ok(Segment { id, path, file: File::from(fd) })
    }

    /// Removes a segment file (by name in this directory, never through a symlink above).
    pub fn remove_segment(&self, id: u64) -> Result<(), SsdError> {
        rustix::fs::unlinkat(&self.fd, segment_name(id).as_str(), rustix::fs::AtFlags::empty())
            .map_err(|e| io_err(&self.segment_path(id), "removing segment", errno(e)))
    }
}

/// One open segment file.
pub struct Segment {
    pub id: u64,
    pub path: PathBuf,
    pub file: File,
}

impl Segment {
    pub fn file_len(&self) -> Result<u64, SsdError> {
        self.file.metadata().map(|m| m.len()).map_err(|e| io_err(&self.path, "stat segment", e))
    }

    /// Reads `buf.len()` bytes (block multiple) at a block-aligned offset; short at EOF.
    pub fn read_at(&self, buf: &mut AlignedBuf, offset: u64) -> Result<usize, SsdError> {
        let mut done = 0;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(&self.path, "reading segment", e)),
            }
        }
        Ok(done)
    }

    /// Writes a block-aligned buffer at a block-aligned offset (footers).
    pub fn write_all_at(&self, buf: &AlignedBuf, len: usize, offset: u64) -> Result<(), SsdError> {
        self.file.write_all_at(&buf[..len], offset).map_err(|e| io_err(&self.path, "writing segment", e))
    }

    /// The footer's entries, if the segment (`len` bytes) has a valid footer (this
    /// directory's salt) that describes sane records: inside the records, sizes and
    /// sequence numbers in range.
    pub fn read_footer(&self, len: u64, salt: &Salt) -> Result<Option<Vec<FooterEntry>>, SsdError> {
        let seg = self;
        if len < BLOCK || !len.is_multiple_of(BLOCK) || len > format::MAX_SEGMENT_BYTES {
            return Ok(None);
        }
        let mut last = AlignedBuf::new(BLOCK as usize);
        if seg.read_at(&mut last, len - BLOCK)? < BLOCK as usize {
            return Ok(None);
        }
        let Ok(t) = format::Trailer::decode(&last, len, salt) else { return Ok(None) };
        let n = (len - BLOCK - t.entries_offset) as usize;
        let mut buf = AlignedBuf::new(n);
        if seg.read_at(&mut buf, t.entries_offset)? < n {
            return Ok(None);
        }
        let Ok(entries) = format::decode_entries(&t, &buf) else { return Ok(None) };
        let sane = entries.iter().all(|e| {
            e.offset.is_multiple_of(BLOCK)
                && format::header_in_range(&e.header)
                && format::checked_record_len(e.header.size)
                    .and_then(|rl| e.offset.checked_add(rl))
                    .is_some_and(|end| end <= t.entries_offset)
        });
        Ok(sane.then_some(entries))
    }

    pub fn sync(&self) -> Result<(), SsdError> {
        self.file.sync_data().map_err(|e| io_err(&self.path, "fdatasync segment", e))
    }

    pub fn truncate(&self, len: u64) -> Result<(), SsdError> {
        self.file.set_len(len).map_err(|e| io_err(&self.path, "truncating segment", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_names_roundtrip() {
        assert_eq!(parse_segment_name(&segment_name(0x1234)), Some(0x1234));
        assert_eq!(parse_segment_name("seg-12.umbp"), None);
        assert_eq!(parse_segment_name("other"), None);
    }

    #[test]
    fn aligned_buf_is_aligned() {
        let b = AlignedBuf::new(10);
        assert_eq!(b.len(), BLOCK as usize);
        assert_eq!(b.as_ptr() as usize % BLOCK as usize, 0);
    }
}
