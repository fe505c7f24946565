//! The pool's death notice in the index header (docs/protocol.md, "Pool liveness"): a
//! thread that registers a Linux robust futex list whose one entry lives in the shared
//! index header, with its thread id in the entry's futex word (`IndexInfo::owner`). When
//! that thread exits, whatever kills the process, the kernel's exit path sets
//! `OWNER_DIED` in the word before the process can be reaped, so schedulers see the pool's
//! death with one load per lookup, without a syscall.
//!
//! With tenant groups (groups.rs) there is one index per group; the list then has one
//! entry per index header (all at the same offset from their futex word), so every
//! group's schedulers see the death word set.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use umbp_protocol::index::IndexView;

use crate::store::Store;

/// `struct robust_list_head` (linux/futex.h): the list (its first entry, circular back to
/// the head), the offset from an entry to its futex word, and the entry being changed.
#[repr(C)]
struct RobustListHead {
    list: *mut libc::c_void,
    futex_offset: libc::c_long,
    list_op_pending: *mut libc::c_void,
}
const _: () = assert!(std::mem::size_of::<RobustListHead>() == 24);

/// The liveness thread: the store (for its groups' index headers) until `stopping`.
pub fn run(store: &Store, stopping: &AtomicBool) {
    if let Err(e) = arm(store) {
        tracing::warn!("pool death word not armed ({e}); schedulers notice a dead pool by its socket only (within 1 ms)");
    }
    // Acquire pairs with `Pool::stop`'s swap, which unparks this thread after it.
    while !stopping.load(Ordering::Acquire) {
        std::thread::park_timeout(Duration::from_millis(200));
    }
    // Returning ends the thread: the kernel marks the word OWNER_DIED (after `Pool::stop`
    // set `closed`, so a graceful stop is seen through both).
}

fn arm(store: &Store) -> Result<(), String> {
    let mut views = Vec::with_capacity(store.group_mem.len());
    for g in &store.group_mem {
        // SAFETY: the pool's own index mapping, alive as long as `store` (longer than this
        // thread, which holds an `Arc` of it until `Pool::stop` joins it).
        views.push(unsafe { IndexView::attach(g.index_mem.as_ptr(), g.index_mem.len()) }.map_err(|e| e.to_string())?);
    }
    let infos: Vec<&umbp_protocol::index::IndexInfo> = views.iter().map(|v| &*v.header().info).collect();
    let entry_of = |info: &umbp_protocol::index::IndexInfo| &info.robust_next as *const _ as *mut libc::c_void;
    let first = *infos.first().ok_or("no index")?;
    let entry = entry_of(first);
    let word = &first.owner as *const _ as usize;
    // Leaked: the kernel reads the head when this thread exits, after `run` returned.
    let head: &'static mut RobustListHead = Box::leak(Box::new(RobustListHead {
        list: entry,
        futex_offset: (word - entry as usize) as libc::c_long,
        list_op_pending: std::ptr::null_mut(),
    }));
    // Each entry's `next` is the next group's entry (all at the same offset from their
    // futex word); the last closes the circle back to the head.
    for (i, info) in infos.iter().enumerate() {
        let next = infos.get(i + 1).map_or(head as *mut RobustListHead as u64, |n| entry_of(n) as u64);
        info.robust_next.store(next, Ordering::Relaxed);
    }
    // SAFETY: `head` is a valid robust_list_head for the life of the thread (leaked); its
    // entries and futex words lie in the index mappings, which outlive this thread. This
    // replaces the list glibc registered for this thread, which takes no robust pthread
    // mutex.
    let rc = unsafe { libc::syscall(libc::SYS_set_robust_list, head as *mut RobustListHead, std::mem::size_of::<RobustListHead>()) };
    if rc != 0 {
        return Err(format!("set_robust_list: {}", std::io::Error::last_os_error()));
    }
    // Armed only once the kernel knows the list: a word with our tid is always cleaned.
    let tid = rustix::thread::gettid().as_raw_nonzero().get() as u32;
    for info in &infos {
        info.owner.store(tid, Ordering::Release);
    }
    tracing::debug!(tid, "pool death word armed");
    Ok(())
}
