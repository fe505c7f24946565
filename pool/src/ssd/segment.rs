//! Segment files and the directories that hold them: naming, opening with O_DIRECT (or
//! buffered, with one warning, where the file system refuses it), the directory checks and
//! lock, and block-aligned buffers.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::format::BLOCK;
use super::SsdError;

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

/// One SSD directory (one drive), checked and locked against a second pool.
pub struct Directory {
    pub path: PathBuf,
    /// Whether files here are opened with O_DIRECT.
    pub direct: bool,
    /// Holds the flock on `.umbp-ssd.lock` for the directory's lifetime.
    _lock: File,
}

fn io_err(path: &Path, what: &str, e: io::Error) -> SsdError {
    SsdError::Io { path: path.to_path_buf(), what: what.to_string(), source: e }
}

impl Directory {
    /// Checks that `path` is an existing, writable directory, locks it, and (with
    /// `try_direct`) probes O_DIRECT.
    pub fn open(path: &Path, try_direct: bool) -> Result<Self, SsdError> {
        let meta = std::fs::metadata(path).map_err(|e| io_err(path, "SSD directory is not accessible", e))?;
        if !meta.is_dir() {
            return Err(SsdError::NotADirectory(path.to_path_buf()));
        }
        let lock_path = path.join(".umbp-ssd.lock");
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .mode(0o600)
            .open(&lock_path)
            .map_err(|e| io_err(path, "SSD directory is not writable (creating .umbp-ssd.lock)", e))?;
        // A read-only bind mount or a directory without write permission for us fails
        // above; a root-owned process passes permission checks, so probe a real write too.
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive).map_err(|e| {
            SsdError::Locked { path: path.to_path_buf(), source: io::Error::from_raw_os_error(e.raw_os_error()) }
        })?;
        let probe_path = path.join(".umbp-ssd.probe");
        if !try_direct {
            return Ok(Self { path: path.to_path_buf(), direct: false, _lock: lock });
        }
        let direct = match OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&probe_path)
        {
            Ok(f) => {
                let buf = AlignedBuf::new(BLOCK as usize);
                match f.write_at(&buf, 0) {
                    Ok(_) => true,
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => false,
                    Err(e) => return Err(io_err(path, "SSD directory refused a test write", e)),
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => false,
            Err(e) => return Err(io_err(path, "SSD directory is not writable", e)),
        };
        let _ = std::fs::remove_file(&probe_path);
        if !direct {
            tracing::warn!(
                dir = %path.display(),
                "SSD directory does not support O_DIRECT (tmpfs?): using buffered I/O; reads may be served from the page cache and throughput figures are not the drive's"
            );
        }
        Ok(Self { path: path.to_path_buf(), direct, _lock: lock })
    }

    /// Segment ids present, ascending.
    pub fn list_segments(&self) -> Result<Vec<u64>, SsdError> {
        let rd = std::fs::read_dir(&self.path).map_err(|e| io_err(&self.path, "listing SSD directory", e))?;
        let mut ids = Vec::new();
        for ent in rd {
            let ent = ent.map_err(|e| io_err(&self.path, "listing SSD directory", e))?;
            if let Some(id) = ent.file_name().to_str().and_then(parse_segment_name) {
                ids.push(id);
            }
        }
        ids.sort_unstable();
        Ok(ids)
    }

    pub fn segment_path(&self, id: u64) -> PathBuf {
        self.path.join(segment_name(id))
    }

    fn options(&self) -> OpenOptions {
        let mut o = OpenOptions::new();
        o.read(true).write(true);
        if self.direct {
            o.custom_flags(libc::O_DIRECT);
        }
        o
    }

    pub fn create_segment(&self, id: u64) -> Result<Segment, SsdError> {
        let path = self.segment_path(id);
        let file = self
            .options()
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| io_err(&path, "creating segment", e))?;
        Ok(Segment { id, path, file })
    }

    pub fn open_segment(&self, id: u64) -> Result<Segment, SsdError> {
        let path = self.segment_path(id);
        let file = self.options().open(&path).map_err(|e| io_err(&path, "opening segment", e))?;
        Ok(Segment { id, path, file })
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
