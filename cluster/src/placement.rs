//! Which peer a remote load pulls from: rendezvous (highest-random-weight) hashing of
//! (key, node) over the peers that hold the key.
//!
//! Ownership model (docs/cluster.md): the pool a block was stored through owns its copy;
//! nothing is pushed to other nodes ahead of demand (the network carries only bytes someone
//! asked for). A pool that loads a remote hit caches the copy locally and from then on
//! advertises it too, so a hot prefix spreads to the nodes that use it. When several peers
//! hold a key, every pool picks the same one by rendezvous score:
//! - deterministic without coordination (no RPC, no shared state);
//! - different keys spread evenly over holders, so one node is not every node's source;
//! - minimal disruption: when a holder leaves, only the keys it was chosen for move, each
//!   to its next-ranked holder (consistent hashing without a ring or virtual nodes);
//! - the same ranking over live members names a key's `home` nodes, the seam for a later
//!   replication factor R (copy to the top R) or a sharded catalog at scale.

use umbp_protocol::ObjectKey;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// A cluster member's stable identity (its node id, from the control handshake).
pub type NodeId = u64;

/// Rendezvous weight of `node` for `key`.
pub fn score(key: ObjectKey, node: NodeId) -> u64 {
    xxh3_64_with_seed(&key.0.to_le_bytes(), node)
}

/// The holder a load of `key` pulls from (None: nobody holds it).
pub fn pick_source(key: ObjectKey, holders: impl IntoIterator<Item = NodeId>) -> Option<NodeId> {
    holders.into_iter().max_by_key(|&n| (score(key, n), n))
}

/// All `members` ranked for `key`, best first (the first R are its home nodes).
pub fn rank(key: ObjectKey, members: &[NodeId]) -> Vec<NodeId> {
    let mut v = members.to_vec();
    v.sort_by_key(|&n| std::cmp::Reverse((score(key, n), n)));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(n: u64) -> impl Iterator<Item = ObjectKey> {
        (0..n).map(|i| ObjectKey((i as u128).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835)))
    }

    #[test]
    fn same_answer_whatever_the_order_of_holders() {
        for k in keys(100) {
            let a = pick_source(k, [1, 2, 3, 4]);
            let b = pick_source(k, [4, 3, 2, 1]);
            assert_eq!(a, b);
            assert_eq!(a, rank(k, &[3, 1, 4, 2]).first().copied());
        }
        assert_eq!(pick_source(ObjectKey(1), []), None);
    }

    #[test]
    fn keys_spread_evenly_over_holders() {
        let nodes = [11, 22, 33, 44];
        let mut count = [0u32; 4];
        for k in keys(40_000) {
            let n = pick_source(k, nodes).unwrap();
            count[nodes.iter().position(|&x| x == n).unwrap()] += 1;
        }
        for c in count {
            assert!((9_000..11_000).contains(&c), "uneven: {count:?}");
        }
    }

    #[test]
    fn a_leaving_holder_moves_only_its_own_keys() {
        let all = [1, 2, 3, 4, 5];
        let without_3 = [1, 2, 4, 5];
        let mut moved = 0;
        for k in keys(10_000) {
            let before = pick_source(k, all).unwrap();
            let after = pick_source(k, without_3).unwrap();
            if before != 3 {
                assert_eq!(before, after, "a key whose source stayed must not move");
            } else {
                moved += 1;
                assert_eq!(after, rank(k, &all)[1], "moves to its next-ranked holder");
            }
        }
        assert!((1_500..2_500).contains(&moved), "{moved}");
    }
}
