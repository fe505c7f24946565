//! Remote entries (the cluster tier, docs/cluster.md): keys a peer pool holds, mirrored in
//! group 0's index marked `Tier::Remote` so schedulers find cross-node hits with a local
//! lookup. They are index entries only — no object, no DRAM, no KV event (the change
//! stream carries this pool's own holdings; re-advertising a peer's keys would echo).
//! A local copy replaces a remote entry in place (`finish_store`); an eviction of the
//! local copy removes the entry (the catalog re-inserts nothing until the holder's next
//! change: at worst a remote hit is missed, never a wrong one).

use umbp_protocol::location::{self, Tier};
use umbp_protocol::ObjectKey;

use super::{GroupKey, ObjectState, ObjectStore};

impl ObjectStore {
    /// Marks group-0 `key` as held by peer `peer` (the location's payload) unless this
    /// pool holds it or the index has no room. Returns whether an entry was added.
    pub fn insert_remote(&mut self, key: ObjectKey, peer: u64) -> bool {
        if self.objects.contains_key(&GroupKey::from(key)) {
            return false;
        }
        let g = &mut self.groups[0];
        if g.index.get(key).is_some() {
            return false;
        }
        matches!(g.index.insert(key, location::encode(Tier::Remote, peer & location::MAX_PAYLOAD)), Ok(umbp_protocol::index::Insert::Inserted))
    }

    /// Removes group-0 `key`'s entry if it is a remote one. Returns whether it was.
    pub fn remove_remote(&mut self, key: ObjectKey) -> bool {
        if !self.is_remote(key) {
            return false;
        }
        self.groups[0].index.remove(key).is_some()
    }

    /// Whether group-0 `key` is in the index as a remote entry (and not held here).
    pub fn is_remote(&self, key: ObjectKey) -> bool {
        !self.objects.contains_key(&GroupKey::from(key))
            && self.groups[0].index.get(key).and_then(location::decode).is_some_and(|(t, _)| t == Tier::Remote)
    }

    /// Keys of the published objects of `group` (a peer's snapshot on join).
    pub fn published_keys(&self, group: u32) -> Vec<ObjectKey> {
        self.objects.iter().filter(|(k, o)| k.group == group && o.state == ObjectState::Published).map(|(k, _)| k.key).collect()
    }

    /// A published `key` the index still marks remote gets `offset` (the local copy
    /// replaces the remote entry without a miss window). Returns whether it did.
    pub(super) fn replace_remote_entry(&mut self, key: GroupKey, offset: u64) -> bool {
        key.group == 0
            && self.groups[0].index.get(key.key).and_then(location::decode).is_some_and(|(t, _)| t == Tier::Remote)
            && {
                let _ = self.groups[0].index.remove(key.key);
                matches!(self.groups[0].index.insert(key.key, offset), Ok(umbp_protocol::index::Insert::Inserted))
            }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use umbp_ipc::SharedMemory;
    use umbp_protocol::index;

    use super::*;
    use crate::objects::StoreReservation;

    fn store() -> ObjectStore {
        let slots = index::slots_for(1 << 24, 4096);
        let mem = SharedMemory::create("idx", index::region_bytes(slots), false).unwrap();
        // SAFETY: fresh zeroed mapping we own.
        unsafe { index::IndexView::init(mem.as_ptr(), mem.len(), slots) }.unwrap();
        ObjectStore::new(1 << 24, Arc::new(mem))
    }

    #[test]
    fn remote_entries_are_index_only_and_removable() {
        let mut s = store();
        let k = ObjectKey(7);
        assert!(s.insert_remote(k, 3));
        assert!(!s.insert_remote(k, 4), "present already");
        assert!(s.is_remote(k));
        assert_eq!(s.groups[0].index.get(k).and_then(location::decode), Some((Tier::Remote, 3)));
        assert_eq!(s.object_count(), 0);
        assert!(s.take_events().is_empty(), "no KV event for a peer's key");
        assert!(s.remove_remote(k) && !s.remove_remote(k));
        assert_eq!(s.groups[0].index.get(k), None);
    }

    #[test]
    fn a_local_copy_replaces_the_remote_entry_and_is_not_removed_as_remote() {
        let mut s = store();
        let k = ObjectKey(9);
        assert!(s.insert_remote(k, 1));
        let StoreReservation::Reserved { offset } = s.reserve_store(0, k, 4096, 1) else { panic!() };
        assert!(s.finish_store(k, true), "publishing over a remote entry");
        assert_eq!(s.groups[0].index.get(k), Some(offset));
        assert!(!s.is_remote(k));
        assert!(!s.remove_remote(k), "the local copy stays");
        assert_eq!(s.published_keys(0), vec![k]);
        assert!(!s.insert_remote(k, 1), "held locally");
    }
}
