//! Attacks on the SSD tier's directory and the pool's other local surfaces (issue #32 items
//! 4 and 5, docs/security.md "The SSD directory", "Metrics"): real files, real processes
//! and sockets. The cross-uid parts need root (a second uid, chown) and go through
//! `root_or_skip` (they fail instead of skipping under UMBP_REQUIRE_ROOT_TESTS).

mod common;

use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use umbp_protocol::ObjectKey;
use umbp_ssd::format::{self, FooterEntry, RecordHeader, BLOCK, HEADER_BYTES};
use umbp_ssd::{segment, SsdConfig, SsdStore};

const NOBODY: u32 = 65534;

/// A fresh directory (0755) under /var/tmp (ext4 here: O_DIRECT works).
fn scratch(tag: &str) -> PathBuf {
    let d = PathBuf::from("/var/tmp").join(format!("umbp-attack-ssd-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
    d
}

/// A 0700 SSD directory `name` in `base`.
fn ssd_dir(base: &Path, name: &str) -> PathBuf {
    let d = base.join(name);
    std::fs::create_dir(&d).unwrap();
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
    d
}

fn cfg(dir: &Path) -> SsdConfig {
    SsdConfig {
        dirs: vec![dir.to_path_buf()],
        capacity_bytes: 64 << 20,
        segment_bytes: 1 << 20,
        queue_depth: 8,
        chunk_bytes: 64 << 10,
        ..SsdConfig::default()
    }
}

fn key(i: u64) -> ObjectKey {
    ObjectKey(0x5eed_0000_0000_0000_0000_0000_0000_0000 | i as u128)
}

/// A file outside every SSD directory that an attacker's link points at.
struct Victim {
    path: PathBuf,
    bytes: Vec<u8>,
}

impl Victim {
    fn new(base: &Path, name: &str) -> Self {
        let path = base.join(name);
        let bytes: Vec<u8> = (0..3 * BLOCK as usize + 100).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        Self { path, bytes }
    }

    fn assert_untouched(&self, what: &str) {
        let now = std::fs::read(&self.path).unwrap();
        assert!(
            now == self.bytes,
            "{what}: the victim file {} was changed ({} bytes, was {})",
            self.path.display(),
            now.len(),
            self.bytes.len()
        );
    }
}

#[test]
fn ssd_files_are_never_opened_through_symlinks() {
    let base = scratch("links");
    // The lock: refused with an error naming it; the victim is not opened.
    let victim = Victim::new(&base, "victim-lock");
    let d = ssd_dir(&base, "lock");
    std::os::unix::fs::symlink(&victim.path, d.join(segment::LOCK_NAME)).unwrap();
    let e = SsdStore::open(&cfg(&d)).err().expect("a symlinked lock file was followed").to_string();
    assert!(e.contains(segment::LOCK_NAME) && e.contains("symbolic link"), "{e}");
    victim.assert_untouched("lock");

    // The O_DIRECT probe's old fixed name: the pool used to truncate and write through it.
    let victim = Victim::new(&base, "victim-probe");
    let d = ssd_dir(&base, "probe");
    std::os::unix::fs::symlink(&victim.path, d.join(".umbp-ssd.probe")).unwrap();
    let store = SsdStore::open(&cfg(&d)).unwrap();
    assert!(store.stats().direct_io, "ext4 under /var/tmp takes O_DIRECT: the probe ran");
    drop(store);
    victim.assert_untouched("probe");
    assert!(std::fs::symlink_metadata(d.join(".umbp-ssd.probe")).unwrap().file_type().is_symlink(), "the planted link stays as it was");

    // Segments: a symlink and a hard link under segment names are refused at start and left
    // alone (the rebuild used to scan the victim and seal it, writing a footer into it).
    let victim = Victim::new(&base, "victim-seg");
    let hard = Victim::new(&base, "victim-hard");
    let d = ssd_dir(&base, "seg");
    std::os::unix::fs::symlink(&victim.path, d.join(segment::segment_name(0))).unwrap();
    std::fs::hard_link(&hard.path, d.join(segment::segment_name(1))).unwrap();
    let store = SsdStore::open(&cfg(&d)).unwrap();
    let st = store.stats();
    assert_eq!((st.segments_refused, st.segments_scanned, st.segments_unreadable), (2, 0, 0), "{st:?}");
    store.put(key(1), 7, 65536, &[0xab; 10_000]).unwrap();
    assert_eq!(store.get(key(1), 7).unwrap().1, vec![0xab; 10_000]);
    drop(store);
    // A restart refuses them again, and still finds its own object.
    let store = SsdStore::open(&cfg(&d)).unwrap();
    assert_eq!(store.stats().segments_refused, 2);
    assert_eq!(store.get(key(1), 7).unwrap().1, vec![0xab; 10_000]);
    drop(store);
    victim.assert_untouched("segment symlink");
    hard.assert_untouched("segment hard link");
    let _ = std::fs::remove_dir_all(&base);
}

/// A one-record segment whose header says `size` and `seq`, valid in every other respect:
/// its CRC (no secret) and its keyed tag, made with the directory's salt (as the pool's own
/// uid could: this is robustness against any bytes on disk, not a tenant's forgery).
fn planted_record(size: u64, seq: u64, salt: &format::Salt) -> Vec<u8> {
    let payload = [0x5au8; 200];
    let h = RecordHeader { flags: 0, key: key(9).0, namespace: 7, size, layout_object_size: 65536, seq, payload_crc: crc32c(&payload) };
    let mut seg = vec![0u8; 4 * BLOCK as usize];
    seg[..HEADER_BYTES].copy_from_slice(&h.encode(salt));
    seg[HEADER_BYTES..HEADER_BYTES + payload.len()].copy_from_slice(&payload);
    seg
}

/// CRC32C (Castagnoli), bit by bit: the format's checksum, computed the slow way.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0x82F6_3B78 } else { crc >> 1 };
        }
    }
    !crc
}

#[test]
fn a_planted_record_with_a_huge_size_does_not_crash_the_rebuild() {
    let base = scratch("huge");
    // A directory a store has opened (it made the salt), then the planted segment.
    let salted = |name: &str| {
        let d = ssd_dir(&base, name);
        drop(SsdStore::open(&cfg(&d)).unwrap());
        let salt = format::Salt::from_file_bytes(&std::fs::read(d.join(umbp_ssd::salt::SALT_NAME)).unwrap()).unwrap();
        (d, salt)
    };
    let cases = [(u64::MAX, 1), (u64::MAX - HEADER_BYTES as u64 + 1, 1), (u64::MAX - 2 * BLOCK, 1), (1 << 50, 1), (200, u64::MAX)];
    for (size, seq) in cases {
        // Scanned (no footer): the header's size used to wrap record_len to one block; a
        // sequence number of 2^64 - 1 would make the store's numbering wrap.
        let (d, salt) = salted(&format!("scan-{size:x}-{seq:x}"));
        std::fs::write(d.join(segment::segment_name(0)), planted_record(size, seq, &salt)).unwrap();
        let store = SsdStore::open(&cfg(&d)).unwrap_or_else(|e| panic!("size {size:#x}: {e}"));
        let st = store.stats();
        assert_eq!((st.objects, st.segments_scanned), (0, 1), "size {size:#x}: {st:?}");
        assert!(st.torn_records_skipped >= 1, "size {size:#x}: {st:?}");
        assert!(store.get(key(9), 7).is_none());
        // The store numbers on from sane numbers: a record written now wins after a restart.
        store.put(key(9), 7, 65536, &[3; 300]).unwrap();
        drop(store);
        let store = SsdStore::open(&cfg(&d)).unwrap_or_else(|e| panic!("restart, size {size:#x}: {e}"));
        assert_eq!(store.get(key(9), 7).map(|g| g.1), Some(vec![3; 300]), "size {size:#x} seq {seq:#x}");
        drop(store);

        // Sealed: a footer entry saying the same (entries and trailer CRCs and tag valid).
        let (d, salt) = salted(&format!("footer-{size:x}-{seq:x}"));
        let mut seg = planted_record(size, seq, &salt);
        let h = RecordHeader::decode(&seg, &salt).unwrap();
        let records_end = seg.len() as u64;
        seg.extend_from_slice(&format::encode_footer(&[FooterEntry { header: h, offset: 0 }], records_end, &salt));
        std::fs::write(d.join(segment::segment_name(0)), &seg).unwrap();
        let store = SsdStore::open(&cfg(&d)).unwrap_or_else(|e| panic!("footer, size {size:#x}: {e}"));
        let st = store.stats();
        assert_eq!((st.objects, st.segments_from_footer), (0, 0), "footer, size {size:#x}: {st:?}");
        assert!(store.get(key(9), 7).is_none());
    }
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn an_ssd_directory_another_user_controls_is_refused() {
    if !root_or_skip("to create SSD directories of another uid") {
        return;
    }
    let base = scratch("owner");
    let theirs = ssd_dir(&base, "theirs");
    std::os::unix::fs::chown(&theirs, Some(NOBODY), Some(NOBODY)).unwrap();
    let open = base.join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let below = ssd_dir(&open, "below");
    for (dir, why) in [
        (&theirs, "owned by uid 65534".to_string()),
        (&open, "0777".into()),
        (&below, format!("the directory above it, {}", open.display())),
    ] {
        let e = SsdStore::open(&cfg(dir))
            .err()
            .unwrap_or_else(|| panic!("the SSD tier opened {}, a directory another user controls", dir.display()));
        let e = e.to_string();
        assert!(e.contains(&dir.display().to_string()) && e.contains(&why) && e.contains("SSD directory"), "{e}");
    }
    // The daemon stops at start, naming the directory.
    let out = std::process::Command::new(pool_binary())
        .arg("--socket")
        .arg(unique_socket("ssd-owner"))
        .args(["--capacity", "16MiB", "--ssd-capacity", "64MiB", "--ssd-segment-size", "4MiB", "--ssd-dir"])
        .arg(&theirs)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains(&theirs.display().to_string()) && err.contains("owned by uid 65534"), "{err}");
    // Sticky and world-writable (as /var/tmp): the pool works in a private 0700
    // subdirectory, where nobody else can plant a file.
    let shared = base.join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let store = SsdStore::open(&cfg(&shared)).unwrap();
    let private = shared.join(segment::private_subdir_name(0));
    assert_eq!(store.dirs(), vec![private.clone()]);
    assert_eq!(std::fs::metadata(&private).unwrap().permissions().mode() & 0o7777, 0o700);
    drop(store);
    // A private subdirectory pre-created by the attacker is refused, not used.
    let shared2 = base.join("shared2");
    std::fs::create_dir(&shared2).unwrap();
    std::fs::set_permissions(&shared2, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let planted = ssd_dir(&shared2, &segment::private_subdir_name(0));
    std::os::unix::fs::chown(&planted, Some(NOBODY), Some(NOBODY)).unwrap();
    let e = SsdStore::open(&cfg(&shared2)).err().expect("an attacker's private subdirectory was used").to_string();
    assert!(e.contains("owned by uid 65534"), "{e}");
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn a_segment_of_another_uid_is_not_restored() {
    if !root_or_skip("to chown a segment to another uid") {
        return;
    }
    let base = scratch("foreign");
    let d = ssd_dir(&base, "ssd");
    {
        let store = SsdStore::open(&cfg(&d)).unwrap();
        for i in 0..4 {
            store.put(key(i), 7, 65536, &[i as u8; 20_000]).unwrap();
        }
    }
    // As if uid 65534 had planted these segments (e.g. through a directory it could write):
    // a victim tenant of namespace 7 would have loaded their bytes.
    let segs = segment::segment_files(&d).unwrap();
    assert!(!segs.is_empty());
    let before: Vec<Vec<u8>> = segs.iter().map(|s| std::fs::read(s).unwrap()).collect();
    for s in &segs {
        std::os::unix::fs::chown(s, Some(NOBODY), Some(NOBODY)).unwrap();
    }
    let store = SsdStore::open(&cfg(&d)).unwrap();
    let st = store.stats();
    assert_eq!((st.objects, st.segments_refused), (0, segs.len() as u64), "{st:?}");
    for i in 0..4 {
        assert!(store.get(key(i), 7).is_none(), "object {i} of a segment of uid 65534 was served");
    }
    // New stores go to new segments; the foreign files are left exactly as they were.
    store.put(key(100), 7, 65536, &[1; 5000]).unwrap();
    drop(store);
    for (s, b) in segs.iter().zip(&before) {
        assert!(std::fs::read(s).unwrap() == *b, "{} was changed", s.display());
        assert_eq!(std::fs::metadata(s).unwrap().uid(), NOBODY);
    }
    let _ = std::fs::remove_dir_all(&base);
}

/// Switches the calling thread (only) to `uid` as its real and effective uid.
fn become_uid(uid: u32) {
    // SAFETY: a raw syscall on this thread's credentials; no memory is passed.
    let rc = unsafe { libc::syscall(libc::SYS_setresuid, uid as libc::c_long, uid as libc::c_long, -1 as libc::c_long) };
    assert_eq!(rc, 0, "setresuid({uid}): {}", std::io::Error::last_os_error());
}

/// `GET /metrics` over the unix socket: Ok(body) or the error that stopped it.
fn scrape_unix(path: &Path) -> std::io::Result<String> {
    let mut s = std::os::unix::net::UnixStream::connect(path)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    Ok(resp)
}

#[test]
fn metrics_on_a_unix_socket_are_unreadable_to_another_uid() {
    if !root_or_skip("to scrape as uid 65534") {
        return;
    }
    let socket = unique_socket("metrics-unix");
    let dir = socket.parent().unwrap().to_path_buf();
    // Others may reach the directory: only the socket's mode and the pool's check stop them.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let metrics = dir.join("metrics.sock");
    let addr = format!("unix:{}", metrics.display());
    let pool = PoolProcess::start(&socket, &["--capacity", "16MiB", "--metrics-addr", &addr]);
    let body = scrape_unix(&metrics).expect("the pool's uid scrapes");
    assert!(body.starts_with("HTTP/1.1 200") && body.contains("umbp_"), "{body}");
    assert_eq!(std::fs::metadata(&metrics).unwrap().permissions().mode() & 0o777, 0o600);
    let as_nobody = |m: PathBuf| {
        std::thread::spawn(move || {
            become_uid(NOBODY);
            scrape_unix(&m)
        })
        .join()
        .unwrap()
    };
    let e = as_nobody(metrics.clone()).expect_err("uid 65534 read the metrics");
    assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
    // Even where the socket's mode is loosened afterwards, the pool answers no other uid.
    std::fs::set_permissions(&metrics, std::fs::Permissions::from_mode(0o666)).unwrap();
    match as_nobody(metrics.clone()) {
        Ok(resp) => assert!(!resp.contains("umbp_"), "uid 65534 read the metrics through a loosened socket: {resp}"),
        Err(e) => assert!(matches!(e.kind(), std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe), "{e}"),
    }
    assert!(scrape_unix(&metrics).unwrap().contains("umbp_"), "the pool's uid still scrapes");
    drop(pool);
}
