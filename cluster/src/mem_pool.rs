//! A minimal [`LocalPool`] over an anonymous mapping: objects at fixed offsets, pins
//! counted, remote keys kept in a set. The cluster's own tests, its test peer process
//! (`umbp-cluster-peer`) and `umbp-bench cluster` run real nodes over it; the pool proper
//! implements `LocalPool` over its object store (docs/cluster.md).

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use umbp_protocol::ObjectKey;

use crate::catalog::{IndexChange, KeyChange};
use crate::node::{LocalPool, Pin};

pub struct MemPool {
    base: *mut u8,
    len: usize,
    /// key → (offset, size, pins, xxh3-128 digest taken at `put`).
    objects: Mutex<HashMap<u128, (u64, u64, u32, u128)>>,
    remote: Mutex<HashSet<(u32, u128)>>,
}

// SAFETY: the mapping is plain memory owned by this struct; which bytes are written by
// whom is the caller's business (put before publishing; fetch into reserved ranges).
unsafe impl Send for MemPool {}
// SAFETY: as above.
unsafe impl Sync for MemPool {}

impl MemPool {
    /// `len` bytes of zeroed anonymous memory.
    pub fn new(len: usize) -> Self {
        // SAFETY: a fresh private anonymous mapping; checked for failure below.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        assert!(p != libc::MAP_FAILED, "mmap {len} bytes: {}", std::io::Error::last_os_error());
        Self { base: p.cast(), len, objects: Mutex::new(HashMap::new()), remote: Mutex::new(HashSet::new()) }
    }

    pub fn base(&self) -> *mut u8 {
        self.base
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Writes `bytes` at `offset` and publishes them as `key`; returns the change to send.
    pub fn put(&self, key: u128, offset: u64, bytes: &[u8]) -> KeyChange {
        assert!(offset as usize + bytes.len() <= self.len, "object past the mapping");
        // SAFETY: in bounds (asserted); nobody reads an unpublished range.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.base.add(offset as usize), bytes.len()) };
        let digest = xxhash_rust::xxh3::xxh3_128(bytes);
        self.objects.lock().unwrap().insert(key, (offset, bytes.len() as u64, 0, digest));
        KeyChange::stored(key, bytes.len() as u64, 0)
    }

    /// Forgets `key`; returns the change to send.
    pub fn remove(&self, key: u128) -> KeyChange {
        self.objects.lock().unwrap().remove(&key);
        KeyChange::removed(key)
    }

    /// A copy of `len` bytes at `offset`.
    pub fn read(&self, offset: u64, len: usize) -> Vec<u8> {
        assert!(offset as usize + len <= self.len);
        // SAFETY: in bounds; the caller reads ranges no transfer is writing.
        unsafe { std::slice::from_raw_parts(self.base.add(offset as usize), len) }.to_vec()
    }

    pub fn pins(&self, key: u128) -> u32 {
        self.objects.lock().unwrap().get(&key).map_or(0, |o| o.2)
    }

    /// Keys the cluster marked remote in this "index".
    pub fn remote_keys(&self) -> HashSet<(u32, u128)> {
        self.remote.lock().unwrap().clone()
    }
}

impl Drop for MemPool {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

impl LocalPool for MemPool {
    fn snapshot(&self) -> Vec<KeyChange> {
        self.objects.lock().unwrap().iter().map(|(&key, o)| KeyChange::stored(key, o.1, 0)).collect()
    }

    fn pin(&self, group: u32, namespace: u128, key: ObjectKey, size: u64) -> Result<Pin, String> {
        if group != 0 || namespace != 0 {
            return Err(format!("group {group}, namespace {namespace:x}: this test pool holds namespace 0 in group 0 only"));
        }
        let mut o = self.objects.lock().unwrap();
        let Some(e) = o.get_mut(&key.0) else { return Err(format!("key {:032x} not held", key.0)) };
        if e.1 != size {
            return Err(format!("key {:032x} is {} bytes, not {size}", key.0, e.1));
        }
        e.2 += 1;
        Ok(Pin { offset: e.0, namespace: 0, digest: e.3 })
    }

    fn unpin(&self, _group: u32, _namespace: u128, key: ObjectKey) {
        if let Some(e) = self.objects.lock().unwrap().get_mut(&key.0) {
            e.2 = e.2.saturating_sub(1);
        }
    }

    fn apply_index(&self, changes: &[IndexChange]) {
        let mut r = self.remote.lock().unwrap();
        for c in changes {
            match *c {
                IndexChange::Insert(o) => r.insert((o.group, o.key.0)),
                IndexChange::Remove((g, k)) => r.remove(&(g, k.0)),
            };
        }
    }
}

/// The bytes the test peer and tests put in object `key` (differs per key and offset).
pub fn pattern(key: u128, len: usize) -> Vec<u8> {
    let seed = (key as u64) ^ ((key >> 64) as u64);
    (0..len).map(|i| (seed.wrapping_mul(0x9e37_79b9).wrapping_add(i as u64 * 7 + (i as u64 >> 12)) >> 3) as u8).collect()
}
