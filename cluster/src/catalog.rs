//! Which keys each peer holds, built from the peers' key change streams (their KV events:
//! a snapshot on join, then `Stored`/`Removed` as they happen), and what the local index
//! must do about it: a key enters the local index (marked `Tier::Remote`) when its first
//! remote holder appears and leaves it when its last one goes. Only DRAM-tier objects are
//! advertised (a peer's SSD objects are not readable over NIXL without a promotion there).
//! Pure: no I/O, no clock.

use std::collections::{HashMap, HashSet};

use umbp_protocol::{ObjectKey, Tier};

use crate::placement::{self, NodeId};

/// An object's identity in the cluster: tenant group and key. Group numbers mean the
/// same on every member because members run the same namespace ACL (the handshake
/// compares digests); the pool side still lists a key only in its namespace's group and
/// pins by namespace (docs/cluster.md, "Namespaces and tenant groups").
pub type CatalogKey = (u32, ObjectKey);

/// One change of a peer's holdings, as its stream carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KeyChange {
    pub group: u32,
    #[serde(with = "u128_hex")]
    pub key: u128,
    pub stored: bool,
    /// `Tier as u8` of the copy that came or went.
    pub tier: u8,
    /// Object size and namespace (Stored; zero in Removed).
    #[serde(default)]
    pub size: u64,
    #[serde(default, with = "u128_hex")]
    pub namespace: u128,
}

impl KeyChange {
    pub fn stored(key: u128, size: u64, namespace: u128) -> Self {
        Self { group: 0, key, stored: true, tier: Tier::Dram as u8, size, namespace }
    }

    pub fn removed(key: u128) -> Self {
        Self { group: 0, key, stored: false, tier: Tier::Dram as u8, size: 0, namespace: 0 }
    }
}

/// What a holder said about an object: size and namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteObject {
    pub group: u32,
    pub key: ObjectKey,
    pub size: u64,
    pub namespace: u128,
}

/// u128 as a 32-digit hex string (JSON numbers stop at 64 bits in serde_json).
pub mod u128_hex {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &u128, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{v:032x}"))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u128, D::Error> {
        let s = <&str>::deserialize(d)?;
        u128::from_str_radix(s, 16).map_err(serde::de::Error::custom)
    }
}

/// What the local index has to do after a catalog change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexChange {
    /// First remote holder: insert the key marked remote (unless held locally).
    Insert(RemoteObject),
    /// No remote holder left: remove the remote entry.
    Remove(CatalogKey),
}

#[derive(Debug, Default)]
pub struct Catalog {
    by_peer: HashMap<NodeId, HashSet<CatalogKey>>,
    holders: HashMap<CatalogKey, Vec<NodeId>>,
    /// Size and namespace, as the first holder said.
    info: HashMap<CatalogKey, (u64, u128)>,
    /// Entries per (peer, tenant group), against [`Self::caps`].
    per_group: HashMap<(NodeId, u32), usize>,
    caps: CatalogCaps,
    /// Keys dropped at a cap (a count, for reports).
    over_cap: u64,
}

/// What one peer may put in the catalog: keys per tenant group, and which groups exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CatalogCaps {
    /// Keys of one peer in one tenant group.
    pub per_group: usize,
    /// Tenant groups here (members run the same ACL): a key of a group past them is dropped.
    pub groups: u32,
}

impl Default for CatalogCaps {
    fn default() -> Self {
        Self { per_group: usize::MAX, groups: u32::MAX }
    }
}

impl Catalog {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_caps(caps: CatalogCaps) -> Self {
        Self { caps, ..Self::default() }
    }

    /// Keys dropped so far because a peer was at its cap (or named no group here).
    pub fn over_cap(&self) -> u64 {
        self.over_cap
    }

    /// Whether `peer` may add one more key of `group`; counts the refusal when not.
    fn room(&mut self, peer: NodeId, group: u32) -> bool {
        let ok = group < self.caps.groups && self.per_group.get(&(peer, group)).copied().unwrap_or(0) < self.caps.per_group;
        if !ok {
            self.over_cap += 1;
        }
        ok
    }

    fn count(&mut self, peer: NodeId, group: u32, up: bool) {
        let n = self.per_group.entry((peer, group)).or_default();
        if up {
            *n += 1;
        } else {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_group.remove(&(peer, group));
            }
        }
    }

    /// Remote keys known (each once, however many holders).
    pub fn len(&self) -> usize {
        self.holders.len()
    }

    pub fn is_empty(&self) -> bool {
        self.holders.is_empty()
    }

    pub fn peer_len(&self, peer: NodeId) -> usize {
        self.by_peer.get(&peer).map_or(0, HashSet::len)
    }

    pub fn holders(&self, k: CatalogKey) -> &[NodeId] {
        self.holders.get(&k).map_or(&[], Vec::as_slice)
    }

    /// `k` as its first holder described it, while some peer holds it.
    pub fn object(&self, k: CatalogKey) -> Option<RemoteObject> {
        let &(size, namespace) = self.info.get(&k)?;
        Some(RemoteObject { group: k.0, key: k.1, size, namespace })
    }

    /// The peer a load of `k` pulls from (placement.rs), if any holds it.
    pub fn source(&self, k: CatalogKey) -> Option<NodeId> {
        placement::pick_source(k.1, self.holders(k).iter().copied())
    }

    /// Applies one change from `peer`'s stream; pushes the index changes it causes.
    pub fn apply(&mut self, peer: NodeId, c: KeyChange, out: &mut Vec<IndexChange>) {
        let k = (c.group, ObjectKey(c.key));
        if c.tier != Tier::Dram as u8 {
            // A non-DRAM copy is not readable remotely; its DRAM copy's own Removed (a
            // demotion) already dropped it, and a Stored elsewhere adds nothing.
            return;
        }
        if c.stored {
            if self.by_peer.get(&peer).is_some_and(|s| s.contains(&k)) || !self.room(peer, k.0) {
                return;
            }
            self.by_peer.entry(peer).or_default().insert(k);
            self.count(peer, k.0, true);
            self.hold(peer, k, (c.size, c.namespace), out);
        } else if self.by_peer.get_mut(&peer).is_some_and(|s| s.remove(&k)) {
            self.count(peer, k.0, false);
            self.unhold(peer, k, out);
        }
    }

    fn hold(&mut self, peer: NodeId, k: CatalogKey, info: (u64, u128), out: &mut Vec<IndexChange>) {
        let h = self.holders.entry(k).or_default();
        h.push(peer);
        if h.len() == 1 {
            self.info.insert(k, info);
            out.push(IndexChange::Insert(RemoteObject { group: k.0, key: k.1, size: info.0, namespace: info.1 }));
        }
    }

    fn unhold(&mut self, peer: NodeId, k: CatalogKey, out: &mut Vec<IndexChange>) {
        if let Some(h) = self.holders.get_mut(&k) {
            h.retain(|&p| p != peer);
            if h.is_empty() {
                self.holders.remove(&k);
                self.info.remove(&k);
                out.push(IndexChange::Remove(k));
            }
        }
    }

    /// A peer left or died: everything only it held leaves the index.
    pub fn drop_peer(&mut self, peer: NodeId, out: &mut Vec<IndexChange>) {
        for k in self.by_peer.remove(&peer).unwrap_or_default() {
            self.unhold(peer, k, out);
        }
        self.per_group.retain(|(p, _), _| *p != peer);
    }

    /// A peer's full holdings (on join or after it overran its stream): replaces what was
    /// known of it.
    pub fn replace_peer(&mut self, peer: NodeId, objects: impl IntoIterator<Item = RemoteObject>, out: &mut Vec<IndexChange>) {
        // Within the caps: at most `per_group` keys of each existing group (the first ones).
        let mut taken: HashMap<u32, usize> = HashMap::new();
        let mut objects_in: HashMap<CatalogKey, (u64, u128)> = HashMap::new();
        for o in objects {
            let n = taken.entry(o.group).or_default();
            if o.group >= self.caps.groups || *n >= self.caps.per_group {
                self.over_cap += 1;
                continue;
            }
            if objects_in.insert((o.group, o.key), (o.size, o.namespace)).is_none() {
                *n += 1;
            }
        }
        let objects = objects_in;
        self.per_group.retain(|(p, _), _| *p != peer);
        for (g, n) in taken {
            if n > 0 {
                self.per_group.insert((peer, g), n);
            }
        }
        let new: HashSet<CatalogKey> = objects.keys().copied().collect();
        let old = self.by_peer.remove(&peer).unwrap_or_default();
        for k in old.difference(&new) {
            self.unhold(peer, *k, out);
        }
        for k in new.difference(&old) {
            self.hold(peer, *k, objects[k], out);
        }
        self.by_peer.insert(peer, new);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(key: u128) -> KeyChange {
        KeyChange::stored(key, 4096, 3)
    }
    fn rm(key: u128) -> KeyChange {
        KeyChange::removed(key)
    }
    fn ro(key: u128) -> RemoteObject {
        RemoteObject { group: 0, key: ObjectKey(key), size: 4096, namespace: 3 }
    }
    fn k(key: u128) -> CatalogKey {
        (0, ObjectKey(key))
    }

    /// A peer's keys past its per-group cap, or of a group that does not exist here, stay
    /// out of the catalog (stream and snapshot alike); a removal makes room again.
    #[test]
    fn a_peer_is_capped_per_tenant_group() {
        let mut c = Catalog::with_caps(CatalogCaps { per_group: 3, groups: 2 });
        let mut out = Vec::new();
        for key in 0..10 {
            c.apply(1, st(key), &mut out);
            c.apply(1, KeyChange { group: 1, ..st(100 + key) }, &mut out);
            c.apply(1, KeyChange { group: 7, ..st(200 + key) }, &mut out);
        }
        assert_eq!((c.peer_len(1), c.over_cap()), (6, 7 + 7 + 10));
        c.apply(2, st(50), &mut out);
        assert_eq!(c.holders(k(50)), &[2], "another peer has its own cap");
        c.apply(1, rm(0), &mut out);
        c.apply(1, st(9), &mut out);
        assert_eq!(c.holders(k(9)), &[1], "room after a removal");
        out.clear();
        c.replace_peer(1, (0..10).map(ro).chain((0..10).map(|key| RemoteObject { group: 9, ..ro(300 + key) })), &mut out);
        assert_eq!(c.peer_len(1), 3, "a snapshot is capped too");
        c.apply(1, st(77), &mut out);
        assert!(c.holders(k(77)).is_empty(), "at the cap after the snapshot");
        c.drop_peer(1, &mut out);
        c.apply(1, st(77), &mut out);
        assert_eq!(c.holders(k(77)), &[1], "a dropped peer's counts are gone");
    }

    #[test]
    fn index_sees_first_holder_in_and_last_holder_out() {
        let mut c = Catalog::new();
        let mut out = Vec::new();
        c.apply(1, st(5), &mut out);
        c.apply(2, st(5), &mut out);
        c.apply(1, st(5), &mut out); // duplicate: nothing
        assert_eq!(out, vec![IndexChange::Insert(ro(5))]);
        out.clear();
        c.apply(1, rm(5), &mut out);
        assert!(out.is_empty(), "peer 2 still holds it");
        assert_eq!(c.holders(k(5)), &[2]);
        c.apply(2, rm(5), &mut out);
        c.apply(2, rm(5), &mut out); // unknown removal: nothing
        assert_eq!(out, vec![IndexChange::Remove(k(5))]);
        assert!(c.is_empty());
    }

    #[test]
    fn a_dead_peer_takes_only_its_sole_holdings_out() {
        let mut c = Catalog::new();
        let mut out = Vec::new();
        for key in 0..10 {
            c.apply(1, st(key), &mut out);
        }
        c.apply(2, st(3), &mut out);
        out.clear();
        c.drop_peer(1, &mut out);
        assert_eq!(out.len(), 9);
        assert!(!out.contains(&IndexChange::Remove(k(3))));
        assert_eq!(c.source(k(3)), Some(2));
        assert_eq!(c.source(k(4)), None);
    }

    #[test]
    fn non_dram_copies_are_not_advertised() {
        let mut c = Catalog::new();
        let mut out = Vec::new();
        c.apply(1, KeyChange { tier: Tier::Ssd as u8, ..KeyChange::stored(9, 1, 0) }, &mut out);
        assert!(out.is_empty() && c.is_empty());
    }

    #[test]
    fn snapshot_replaces_a_peers_view() {
        let mut c = Catalog::new();
        let mut out = Vec::new();
        c.apply(1, st(1), &mut out);
        c.apply(1, st(2), &mut out);
        out.clear();
        c.replace_peer(1, [ro(2), ro(3)], &mut out);
        out.sort_by_key(|c| format!("{c:?}"));
        assert_eq!(out, vec![IndexChange::Insert(ro(3)), IndexChange::Remove(k(1))]);
        assert_eq!(c.peer_len(1), 2);
    }
}
