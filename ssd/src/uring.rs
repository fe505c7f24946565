//! One io_uring per drive: a fixed set of block-aligned buffers registered once, and batched
//! reads and writes split into buffer-sized chunks with up to `depth` of them in flight.
//!
//! Callers describe whole records; the ring copies them through its registered buffers
//! (gather on write, a caller's sink on read), so the caller's memory needs no alignment.

use std::io;
use std::os::fd::RawFd;

use io_uring::{opcode, types, IoUring};

use super::segment::AlignedBuf;

/// A write of `len` bytes (block multiple) at `offset`: the concatenation of `pieces`,
/// zero padded to `len`.
pub struct WriteJob<'a> {
    pub fd: RawFd,
    pub offset: u64,
    pub len: u64,
    pub pieces: Vec<&'a [u8]>,
}

/// Receives read chunks: (offset inside the job, bytes).
pub type Sink<'a> = dyn FnMut(u64, &[u8]) + 'a;

/// A read of `len` bytes (block multiple) at `offset`; every chunk is handed to `sink` with
/// its offset inside the job, in completion order.
pub struct ReadJob<'a> {
    pub fd: RawFd,
    pub offset: u64,
    pub len: u64,
    pub sink: &'a mut Sink<'a>,
}

pub struct Ring {
    /// None: io_uring is refused here; chunks run one at a time with pread/pwrite.
    ring: Option<IoUring>,
    bufs: Vec<AlignedBuf>,
    chunk: usize,
    /// Buffers were registered (READ_FIXED/WRITE_FIXED); else plain READ/WRITE.
    fixed: bool,
}

struct Chunk {
    job: usize,
    at: u64,
    len: usize,
}

impl Ring {
    /// A ring with `depth` entries and `depth` registered buffers of `chunk` bytes. Where
    /// the kernel refuses io_uring (disabled by sysctl, blocked by a seccomp profile: EPERM,
    /// ENOSYS, EACCES) or `use_uring` is false, the same calls run synchronously with
    /// pread/pwrite (one warning); other errors are returned.
    pub fn new(depth: u32, chunk: usize, use_uring: bool) -> io::Result<Self> {
        let depth = depth.clamp(1, 4096);
        let chunk = chunk.max(4096).next_multiple_of(4096);
        let ring = if use_uring {
            match IoUring::new(depth) {
                Ok(r) => Some(r),
                Err(e) if matches!(e.raw_os_error(), Some(libc::EPERM | libc::ENOSYS | libc::EACCES)) => {
                    tracing::warn!(error = %e, "io_uring refused by the kernel: SSD I/O falls back to synchronous pread/pwrite (much slower)");
                    None
                }
                Err(e) => return Err(e),
            }
        } else {
            None
        };
        let Some(ring) = ring else {
            return Ok(Self { ring: None, bufs: vec![AlignedBuf::new(chunk)], chunk, fixed: false });
        };
        let bufs: Vec<AlignedBuf> = (0..depth).map(|_| AlignedBuf::new(chunk)).collect();
        let iovecs: Vec<libc::iovec> = bufs.iter().map(|b| libc::iovec { iov_base: b.as_ptr().cast(), iov_len: b.len() }).collect();
        // SAFETY: the buffers live as long as the ring (both are fields of Self; the ring is
        // dropped, unregistering them, before or with them) and are never reallocated.
        let fixed = match unsafe { ring.submitter().register_buffers(&iovecs) } {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "io_uring buffer registration failed; using unregistered buffers");
                false
            }
        };
        Ok(Self { ring: Some(ring), bufs, chunk, fixed })
    }

    /// Whether I/O goes through io_uring (else synchronous pread/pwrite).
    pub fn is_uring(&self) -> bool {
        self.ring.is_some()
    }

    pub fn depth(&self) -> usize {
        self.bufs.len()
    }

    pub fn chunk_bytes(&self) -> usize {
        self.chunk
    }

    fn chunks(&self, lens: impl Iterator<Item = u64>) -> Vec<Chunk> {
        let mut out = Vec::new();
        // Each job in the fewest chunks, of near-equal block-aligned sizes (a record one
        // block over the chunk size is two half chunks, not a chunk and a block).
        for (job, len) in lens.enumerate() {
            let blocks = len.div_ceil(4096);
            let n = len.div_ceil(self.chunk as u64).max(1);
            let mut at = 0;
            for i in 0..n {
                let end = (blocks * (i + 1) / n * 4096).min(len);
                if end > at {
                    out.push(Chunk { job, at, len: (end - at) as usize });
                }
                at = end;
            }
        }
        out
    }

    /// Runs `ops` chunks, at most `depth` in flight. `fill(chunk, buf)` prepares a write
    /// buffer; `done(chunk, buf, result)` consumes a completion. Returns per-job errors.
    fn run(
        &mut self,
        write: bool,
        fds: &[(RawFd, u64)],
        chunks: &[Chunk],
        mut fill: impl FnMut(&Chunk, &mut [u8]),
        mut done: impl FnMut(&Chunk, &[u8]),
    ) -> Vec<Option<io::Error>> {
        let mut errors: Vec<Option<io::Error>> = (0..fds.len()).map(|_| None).collect();
        let Some(ring) = self.ring.as_mut() else {
            for c in chunks {
                if errors[c.job].is_some() {
                    continue;
                }
                let (fd, base) = fds[c.job];
                let buf = &mut self.bufs[0][..c.len];
                if write {
                    fill(c, buf);
                }
                match sync_io(write, fd, buf, base + c.at) {
                    Ok(()) if !write => done(c, buf),
                    Ok(()) => {}
                    Err(e) => errors[c.job] = Some(e),
                }
            }
            return errors;
        };
        let mut free: Vec<u16> = (0..self.bufs.len() as u16).rev().collect();
        // Chunk index per buffer in flight.
        let mut owner: Vec<usize> = vec![usize::MAX; self.bufs.len()];
        let mut next = 0;
        let mut in_flight = 0usize;
        while next < chunks.len() || in_flight > 0 {
            while next < chunks.len() {
                let Some(&b) = free.last() else { break };
                let c = &chunks[next];
                if errors[c.job].is_some() {
                    next += 1;
                    continue;
                }
                free.pop();
                let (fd, base) = fds[c.job];
                let buf = &mut self.bufs[b as usize];
                if write {
                    fill(c, &mut buf[..c.len]);
                }
                let ptr = buf.as_ptr();
                let fd = types::Fd(fd);
                let off = base + c.at;
                let entry = match (write, self.fixed) {
                    (true, true) => opcode::WriteFixed::new(fd, ptr, c.len as u32, b).offset(off).build(),
                    (true, false) => opcode::Write::new(fd, ptr, c.len as u32).offset(off).build(),
                    (false, true) => opcode::ReadFixed::new(fd, ptr, c.len as u32, b).offset(off).build(),
                    (false, false) => opcode::Read::new(fd, ptr, c.len as u32).offset(off).build(),
                };
                owner[b as usize] = next;
                // SAFETY: the buffer stays allocated and untouched by us until its
                // completion is reaped below (we wait for every in-flight entry before
                // returning), and the fd outlives this call (the caller holds the file).
                let pushed = unsafe { ring.submission().push(&entry.user_data(b as u64)) };
                if pushed.is_err() {
                    // Cannot happen: entries == buffers, and each entry holds a buffer.
                    free.push(b);
                    break;
                }
                next += 1;
                in_flight += 1;
            }
            if in_flight == 0 {
                continue;
            }
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted || e.raw_os_error() == Some(libc::EBUSY) => {}
                Err(e) => {
                    // The ring itself failed: in-flight entries may still complete; wait
                    // for them so no buffer is reused under the kernel, then fail all jobs.
                    tracing::error!(error = %e, "io_uring submit failed");
                    let kind = e.kind();
                    while in_flight > 0 {
                        if ring.submit_and_wait(1).is_err() {
                            break;
                        }
                        in_flight -= ring.completion().count();
                    }
                    for err in errors.iter_mut().filter(|e| e.is_none()) {
                        *err = Some(io::Error::new(kind, format!("io_uring submit failed: {e}")));
                    }
                    return errors;
                }
            }
            let cqes: Vec<(u16, i32)> = ring.completion().map(|c| (c.user_data() as u16, c.result())).collect();
            for (b, res) in cqes {
                in_flight -= 1;
                let c = &chunks[owner[b as usize]];
                if res < 0 {
                    errors[c.job].get_or_insert(io::Error::from_raw_os_error(-res));
                } else if res as usize != c.len {
                    // A short transfer is no error by itself (a write stops at the file
                    // size limit or a full disk, a read at the end of the file): the rest
                    // goes again, synchronously, and completes or fails with the kernel's
                    // reason (EFBIG, ENOSPC: disk full; a read past the end: short read).
                    let (fd, base) = fds[c.job];
                    let n = res as usize;
                    match sync_io(write, fd, &mut self.bufs[b as usize][n..c.len], base + c.at + n as u64) {
                        Ok(()) if !write => done(c, &self.bufs[b as usize][..c.len]),
                        Ok(()) => {}
                        Err(e) => {
                            errors[c.job].get_or_insert(e);
                        }
                    }
                } else if !write {
                    done(c, &self.bufs[b as usize][..c.len]);
                }
                free.push(b);
            }
        }
        errors
    }

    /// Writes every job; per-job result.
    pub fn write_batch(&mut self, jobs: &[WriteJob<'_>]) -> Vec<io::Result<()>> {
        let chunks = self.chunks(jobs.iter().map(|j| j.len));
        let fds: Vec<(RawFd, u64)> = jobs.iter().map(|j| (j.fd, j.offset)).collect();
        let errors = self.run(true, &fds, &chunks, |c, buf| gather(&jobs[c.job].pieces, c.at, buf), |_, _| {});
        errors.into_iter().map(|e| e.map_or(Ok(()), Err)).collect()
    }

    /// Reads every job; per-job result (a job with an error may have had some chunks sunk).
    pub fn read_batch(&mut self, jobs: &mut [ReadJob<'_>]) -> Vec<io::Result<()>> {
        let chunks = self.chunks(jobs.iter().map(|j| j.len));
        let fds: Vec<(RawFd, u64)> = jobs.iter().map(|j| (j.fd, j.offset)).collect();
        let errors = self.run(false, &fds, &chunks, |_, _| {}, |c, data| (jobs[c.job].sink)(c.at, data));
        errors.into_iter().map(|e| e.map_or(Ok(()), Err)).collect()
    }
}

/// One whole pread/pwrite of `buf` at `offset` (retried on EINTR and short transfers).
fn sync_io(write: bool, fd: RawFd, buf: &mut [u8], offset: u64) -> io::Result<()> {
    let mut done = 0usize;
    while done < buf.len() {
        let rest = &mut buf[done..];
        let off = (offset + done as u64) as libc::off_t;
        // SAFETY: `rest` is valid for `rest.len()` bytes (read from for pwrite, written to
        // for pread) for the duration of the call.
        let n = unsafe {
            if write {
                libc::pwrite(fd, rest.as_ptr().cast(), rest.len(), off)
            } else {
                libc::pread(fd, rest.as_mut_ptr().cast(), rest.len(), off)
            }
        };
        match n {
            n if n > 0 => done += n as usize,
            0 => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("short {} at {offset}", if write { "write" } else { "read" }),
                ))
            }
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

/// Copies bytes `[at, at + buf.len())` of the concatenation of `pieces` into `buf`, zero
/// filling past their end.
fn gather(pieces: &[&[u8]], at: u64, buf: &mut [u8]) {
    let mut pos = 0u64; // start of the current piece in the stream
    let mut filled = 0usize;
    let end = at + buf.len() as u64;
    for p in pieces {
        let p_end = pos + p.len() as u64;
        if p_end > at && pos < end {
            let from = at.max(pos);
            let to = end.min(p_end);
            let n = (to - from) as usize;
            let dst = (from - at) as usize;
            buf[dst..dst + n].copy_from_slice(&p[(from - pos) as usize..(to - pos) as usize]);
            filled = filled.max(dst + n);
        }
        pos = p_end;
        if pos >= end {
            break;
        }
    }
    buf[filled..].fill(0);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_concatenates_and_pads() {
        let pieces: Vec<&[u8]> = vec![b"abc", b"", b"defgh"];
        let mut buf = [9u8; 4];
        gather(&pieces, 0, &mut buf);
        assert_eq!(&buf, b"abcd");
        gather(&pieces, 2, &mut buf);
        assert_eq!(&buf, b"cdef");
        gather(&pieces, 6, &mut buf);
        assert_eq!(&buf, b"gh\0\0");
        gather(&pieces, 100, &mut buf);
        assert_eq!(&buf, b"\0\0\0\0");
    }

    #[test]
    fn records_split_into_the_fewest_near_equal_aligned_chunks() {
        let r = Ring::new(4, 64 << 10, true).expect("io_uring");
        let sizes = |len: u64| r.chunks(std::iter::once(len)).iter().map(|c| c.len).collect::<Vec<_>>();
        assert_eq!(sizes(4096), vec![4096]);
        assert_eq!(sizes(64 << 10), vec![64 << 10]);
        assert_eq!(sizes((64 << 10) + 4096), vec![32768, 36864]);
        let c = r.chunks([3 * 4096, 200 << 10].into_iter());
        assert_eq!(c.iter().filter(|c| c.job == 1).map(|c| c.len).sum::<usize>(), 200 << 10);
        assert!(c.iter().all(|c| c.len % 4096 == 0 && c.len <= 64 << 10));
    }
}
