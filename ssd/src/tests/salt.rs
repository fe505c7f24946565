//! The directory's salt file (format 2, issue #34, S4): created private with the
//! directory, never followed through a link, refused when others may read it, and a
//! directory of format 1 (segments, no salt) emptied, not read.

use std::os::unix::fs::PermissionsExt;

use super::*;
use crate::salt::SALT_NAME;

fn c(d: &Path) -> SsdConfig {
    cfg(&[d], 64 << 20, 8 << 20)
}

fn open_err(d: &Path) -> String {
    match SsdStore::open(&c(d)) {
        Ok(_) => panic!("{} opened", d.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn the_salt_is_created_private_and_differs_between_directories() {
    let (a, b) = (tempdir(), tempdir());
    drop(open_store(&c(a.path())));
    drop(open_store(&c(b.path())));
    let m = std::fs::symlink_metadata(a.path().join(SALT_NAME)).unwrap();
    assert!(m.is_file());
    assert_eq!(m.permissions().mode() & 0o777, 0o600);
    assert_ne!(dir_salt(a.path()), dir_salt(b.path()), "each directory has its own secret");
    // A restart keeps it: records written before are found.
    let s = open_store(&c(a.path()));
    s.put(key(1), 7, 65536, &payload(1, 5000)).unwrap();
    let salt = dir_salt(a.path());
    drop(s);
    let s = open_store(&c(a.path()));
    assert_eq!(dir_salt(a.path()), salt);
    assert!(s.get(key(1), 7).unwrap().1 == payload(1, 5000));
}

#[test]
fn a_directory_of_format_1_is_emptied_and_opens_with_a_new_salt() {
    let d = tempdir();
    // Segments and no salt file: what a pool of format 1 left. Its records cannot be told
    // from forgeries, so none is listed: the segments are removed and the store opens empty.
    let seg = d.path().join(segment::segment_name(0));
    std::fs::write(&seg, vec![0u8; 8192]).unwrap();
    let s = open_store(&c(d.path()));
    assert!(!seg.exists(), "a segment written without a salt is still there");
    assert!(d.path().join(SALT_NAME).exists());
    s.put(key(1), 7, 65536, &payload(1, 5000)).unwrap();
    assert!(s.get(key(1), 7).unwrap().1 == payload(1, 5000));
}

#[test]
fn a_salt_file_others_may_read_or_a_link_is_refused() {
    let d = tempdir();
    drop(open_store(&c(d.path())));
    let p = d.path().join(SALT_NAME);
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
    let e = open_err(d.path());
    assert!(e.contains(&p.display().to_string()) && e.contains("0644"), "{e}");
    std::fs::remove_file(&p).unwrap();
    let elsewhere = tempdir();
    std::fs::write(elsewhere.path().join("x"), salt_bytes()).unwrap();
    std::os::unix::fs::symlink(elsewhere.path().join("x"), &p).unwrap();
    let e = open_err(d.path());
    assert!(e.contains(&p.display().to_string()) && e.contains("symbolic link"), "{e}");
}

fn salt_bytes() -> [u8; 32] {
    format::Salt::new([7; 16]).file_bytes()
}

#[test]
fn a_salt_file_cut_short_is_made_again_only_where_no_segment_depends_on_it() {
    let d = tempdir();
    let p = d.path().join(SALT_NAME);
    // A crash while creating it: empty, no segment yet.
    std::fs::write(&p, b"").unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    let s = open_store(&c(d.path()));
    s.put(key(1), 7, 65536, &payload(1, 5000)).unwrap();
    drop(s);
    assert_eq!(std::fs::read(&p).unwrap().len(), format::SALT_FILE_BYTES);
    // Cut short with segments beside it: refused, never replaced (they would all be lost
    // silently, or worse, checked with another key).
    std::fs::write(&p, &salt_bytes()[..20]).unwrap();
    let e = open_err(d.path());
    assert!(e.contains(&p.display().to_string()) && e.contains("not a salt file"), "{e}");
    assert_eq!(std::fs::read(&p).unwrap().len(), 20);
}
