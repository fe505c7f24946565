//! Isolation between peers and tenants, against a real `umbp-pool` process: the socket's
//! mode and group, the uid allow-list, the namespace ACL (refused Hellos, and loads that
//! cannot reach another tenant's blocks), and sealed memfds that no peer can resize, reseal
//! or map writable (docs/security.md). Tests that act as other users need root; they print
//! why and skip otherwise.

mod common;

use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::Path;

use common::{handshake, memfd_worker, start_pool, unique_socket, RawPeer};
use umbp_protocol::entries::{BlockRef, BlockStatus, Opcode, Sqe};
use umbp_protocol::wire::{Hello, Role};
use umbp_protocol::ObjectKey;

const PAGE: u64 = 4096;
const BLOCKS: u64 = 16;

/// Runs `f` in a forked child with the given credentials and returns what it wrote.
fn as_user(uid: u32, gid: u32, f: impl FnOnce() -> String) -> String {
    let (mut r, w) = UnixStream::pair().unwrap();
    // SAFETY: the child runs `f` (plain socket calls) and leaves with _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: in the child; drop supplementary groups, then gid, then uid.
        let ok = unsafe { libc::setgroups(0, std::ptr::null()) == 0 && libc::setgid(gid) == 0 && libc::setuid(uid) == 0 };
        let msg = if ok { f() } else { format!("cannot become {uid}:{gid}") };
        let _ = (&w).write_all(msg.as_bytes());
        // SAFETY: leave the forked child without running the parent's destructors.
        unsafe { libc::_exit(0) };
    }
    drop(w);
    let mut out = String::new();
    r.read_to_string(&mut out).unwrap();
    // SAFETY: reaping our child.
    unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
    out
}

/// Connects and says Hello with `namespace`; "attached" or the refusal text.
fn hello_from_child(socket: &Path, role: Role, namespace: u128) -> String {
    match UnixStream::connect(socket) {
        Ok(s) => match handshake(&s, &Hello::new(role, namespace, std::process::id())) {
            Ok(_) => "attached".into(),
            Err(e) => e,
        },
        Err(e) => format!("connect: {e}"),
    }
}

fn open_up(socket: &Path) {
    std::fs::set_permissions(socket.parent().unwrap(), std::fs::Permissions::from_mode(0o777)).unwrap();
}

#[test]
fn socket_is_0660_and_belongs_to_the_socket_group() {
    let pool = start_pool(&unique_socket("mode"), &[]);
    let meta = std::fs::metadata(&pool.socket).unwrap();
    assert_eq!(meta.mode() & 0o777, 0o660, "default socket mode");
    assert_eq!(meta.gid(), rustix::process::getgid().as_raw(), "default group: the pool's");
    drop(pool);

    let bad = std::process::Command::new(umbp_integration_tests::pool_binary())
        .args(["--socket-group", "no-such-group-umbp", "--capacity", "16MiB"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("socket-group") && err.contains("no-such-group-umbp"), "{err}");

    if !umbp_integration_tests::root_or_skip("the other-user half: to chgrp the socket and act as another user") {
        return;
    }
    let pool = start_pool(&unique_socket("group"), &["--socket-group", "65534"]);
    let meta = std::fs::metadata(&pool.socket).unwrap();
    assert_eq!((meta.mode() & 0o777, meta.gid()), (0o660, 65534));
    open_up(&pool.socket);
    let s = pool.socket.clone();
    // Not in the group: the kernel refuses the connect itself.
    let outsider = as_user(65534, 12345, || hello_from_child(&s, Role::Scheduler, 1));
    assert!(outsider.starts_with("connect:") && outsider.contains("ermission denied"), "{outsider}");
    // In the group: connects, and is then judged by the uid allow-list.
    let member = as_user(65534, 65534, || hello_from_child(&s, Role::Scheduler, 1));
    assert!(member.contains("uid 65534 is not allowed"), "{member}");
    drop(pool);
    let pool = start_pool(&unique_socket("group2"), &["--socket-group", "65534", "--allow-uid", "65534"]);
    open_up(&pool.socket);
    let s = pool.socket.clone();
    assert_eq!(as_user(65534, 65534, || hello_from_child(&s, Role::Scheduler, 1)), "attached");
}

#[test]
fn namespace_acl_refuses_other_namespaces_and_unlisted_uids() {
    if !umbp_integration_tests::root_or_skip("to act as other uids") {
        return;
    }
    let pool = start_pool(&unique_socket("acl"), &["--allow-uid", "65534", "--allow-uid", "65533", "--namespace-acl", "65534:aa,0xbb"]);
    open_up(&pool.socket);
    std::fs::set_permissions(&pool.socket, std::fs::Permissions::from_mode(0o777)).unwrap();
    let s = pool.socket.clone();
    assert_eq!(as_user(65534, 65534, || hello_from_child(&s, Role::Worker, 0xaa)), "attached");
    assert_eq!(as_user(65534, 65534, || hello_from_child(&s, Role::Scheduler, 0xbb)), "attached");
    let other_ns = as_user(65534, 65534, || hello_from_child(&s, Role::Worker, 0xcc));
    assert!(other_ns.contains("namespace 000000000000000000000000000000cc is not allowed for uid 65534"), "{other_ns}");
    // Allowed to connect, but no ACL entry: refused once ACLs are in force.
    let unlisted = as_user(65533, 65533, || hello_from_child(&s, Role::Scheduler, 0xaa));
    assert!(unlisted.contains("not allowed for uid 65533") && unlisted.contains("--namespace-acl"), "{unlisted}");
    // The pool's own uid is not restricted.
    assert!(RawPeer::attach(&pool.socket, Role::Scheduler, 0x1234).is_ok());
    assert!(pool.report().counters.refusals >= 2);
}

fn one(peer: &RawPeer, op: Opcode, key: u128, block: u64) -> BlockStatus {
    let a = peer.arena();
    a.write(0, &[BlockRef::new(ObjectKey(key), block)]).unwrap();
    let s = Sqe { opcode: op as u8, count: 1, refs_offset: 0, status_offset: 1024, user_data: 5, ..Sqe::default() };
    let c = peer.submit_and_reap(&[s]);
    assert_eq!(c[0].result, 0);
    BlockStatus::from_u8(a.read::<u8>(1024, 1).unwrap()[0])
}

#[test]
fn with_an_acl_loads_only_find_the_loaders_namespace() {
    let pool = start_pool(&unique_socket("acl-load"), &["--namespace-acl", "65534:aa"]);
    let (tenant_a, mem_a) = memfd_worker(&pool, 0xaa, PAGE, BLOCKS, 0xA1);
    let (tenant_b, mem_b) = memfd_worker(&pool, 0xbb, PAGE, BLOCKS, 0xB2);
    assert_eq!(one(&tenant_a, Opcode::Store, 1, 0), BlockStatus::Stored);
    // B knows A's key: still a miss, never A's bytes.
    assert_eq!(one(&tenant_b, Opcode::Load, 1, 1), BlockStatus::Missing);
    // B stores first under a key A will use (poisoning): A's load misses instead of
    // returning B's bytes; A recomputes.
    assert_eq!(one(&tenant_b, Opcode::Store, 2, 2), BlockStatus::Stored);
    assert_eq!(one(&tenant_a, Opcode::Load, 2, 3), BlockStatus::Missing);
    // SAFETY: inside the mappings.
    let (a3, b1) = unsafe { (*mem_a.as_ptr().add(3 * PAGE as usize), *mem_b.as_ptr().add(PAGE as usize)) };
    assert_eq!((a3, b1), (0xA1, 0xB2), "no foreign bytes were written");
    // Each tenant still reads its own.
    assert_eq!(one(&tenant_a, Opcode::Load, 1, 4), BlockStatus::Loaded);
    assert_eq!(one(&tenant_b, Opcode::Load, 2, 5), BlockStatus::Loaded);

    // Without an ACL the pool keeps its shared-pool behaviour (one namespace per model).
    let open = start_pool(&unique_socket("no-acl"), &[]);
    let (a, _ma) = memfd_worker(&open, 0xaa, PAGE, BLOCKS, 1);
    let (b, _mb) = memfd_worker(&open, 0xbb, PAGE, BLOCKS, 2);
    assert_eq!(one(&a, Opcode::Store, 9, 0), BlockStatus::Stored);
    assert_eq!(one(&b, Opcode::Load, 9, 1), BlockStatus::Loaded);
}

fn errno_of<T>(r: rustix::io::Result<T>) -> Option<rustix::io::Errno> {
    r.err()
}

/// Every way a peer could resize, reseal or write a region it was given read-only.
fn assert_index_is_read_only(fd: BorrowedFd<'_>, len: usize) {
    use rustix::fs::{fallocate, fcntl_add_seals, ftruncate, FallocateFlags, SealFlags};
    use rustix::io::Errno;
    use rustix::mm::{mmap, mprotect, munmap, MapFlags, MprotectFlags, ProtFlags};
    assert_eq!(errno_of(ftruncate(fd, len as u64 * 2)), Some(Errno::PERM), "grow");
    assert_eq!(errno_of(ftruncate(fd, 4096)), Some(Errno::PERM), "shrink");
    assert_eq!(errno_of(fallocate(fd, FallocateFlags::empty(), 0, len as u64 * 2)), Some(Errno::PERM), "fallocate");
    assert_eq!(errno_of(fcntl_add_seals(fd, SealFlags::empty())), Some(Errno::PERM), "seals are final");
    assert_eq!(errno_of(rustix::io::pwrite(fd, &[1u8; 8], 0)), Some(Errno::PERM), "write(2)");
    // SAFETY: a fresh mapping chosen by the kernel (refused: nothing to unmap).
    let rw = unsafe { mmap(std::ptr::null_mut(), len, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, fd, 0) };
    assert_eq!(errno_of(rw), Some(Errno::PERM), "writable shared mapping");
    // SAFETY: a fresh mapping chosen by the kernel, unmapped below.
    let ro = unsafe { mmap(std::ptr::null_mut(), len, ProtFlags::READ, MapFlags::SHARED, fd, 0) }.unwrap();
    // SAFETY: our own mapping.
    let up = unsafe { mprotect(ro, len, MprotectFlags::READ | MprotectFlags::WRITE) };
    assert_eq!(errno_of(up), Some(Errno::ACCESS), "mprotect of a read-only mapping to writable");
    // SAFETY: our own mapping.
    unsafe { munmap(ro, len) }.unwrap();
    // Re-opening the memfd through /proc gives a new writable description of the same
    // inode; the seals are on the inode, so it cannot write either.
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    let reopened = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    // SAFETY: a fresh mapping chosen by the kernel (refused: nothing to unmap).
    let rw = unsafe { mmap(std::ptr::null_mut(), len, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, reopened.as_fd(), 0) };
    assert_eq!(errno_of(rw), Some(Errno::PERM), "writable mapping through /proc/self/fd");
    assert_eq!(errno_of(ftruncate(reopened.as_fd(), 0)), Some(Errno::PERM), "truncate through /proc/self/fd");
}

#[test]
fn peers_cannot_resize_reseal_or_write_the_index() {
    let pool = start_pool(&unique_socket("seal"), &[]);
    let (w, _mem) = memfd_worker(&pool, 1, PAGE, BLOCKS, 7);
    assert_eq!(one(&w, Opcode::Store, 77, 0), BlockStatus::Stored);
    assert_index_is_read_only(w.index.fd(), w.index.len());
    let sched = RawPeer::attach(&pool.socket, Role::Scheduler, 1).unwrap();
    assert_index_is_read_only(sched.index.fd(), sched.index.len());
    // The ring memfd is the peer's to write, but not to resize or reseal.
    use rustix::fs::{fcntl_add_seals, ftruncate, SealFlags};
    assert_eq!(errno_of(ftruncate(w.rings.fd(), 0)), Some(rustix::io::Errno::PERM));
    assert_eq!(errno_of(ftruncate(w.rings.fd(), w.rings.len() as u64 * 2)), Some(rustix::io::Errno::PERM));
    assert_eq!(errno_of(fcntl_add_seals(w.rings.fd(), SealFlags::WRITE)), Some(rustix::io::Errno::PERM));
    // Nothing the peers tried changed the pool: it still serves and still finds the block.
    assert_eq!(one(&w, Opcode::Load, 77, 5), BlockStatus::Loaded);
    let (w2, _m2) = memfd_worker(&pool, 1, PAGE, BLOCKS, 9);
    assert_eq!(one(&w2, Opcode::Load, 77, 1), BlockStatus::Loaded);
}
