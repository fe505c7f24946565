//! Tenant groups (docs/security.md, "Indexes and event logs per tenant group"): with
//! `--namespace-acl`, namespaces listed for exactly the same set of uids form one group,
//! and each group has its own index and KV event log (own memfds, own seed). A peer is
//! handed the index and log of its Hello namespace's group only, so it maps no index or
//! log that holds a namespace it may not read. Group 0 holds every namespace the ACL does
//! not list (only the pool's uid and root may attach with one). Without an ACL there is
//! one group, 0: one index and one log for everyone.
//!
//! Pure: the partition is a function of the ACL, computed once at start.

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Most groups a pool makes (each is an index and an event log, and the pool's death
/// word in every index header is one entry of one robust futex list, which the kernel
/// walks for at most 2048 entries).
pub const MAX_GROUPS: usize = 1024;

/// One tenant group: the uids that may read it and its namespaces (both sorted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSpec {
    /// Empty for group 0 (the pool's uid and root only).
    pub uids: Vec<u32>,
    /// Empty for group 0: "every namespace not listed".
    pub namespaces: Vec<u128>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantGroups {
    groups: Vec<GroupSpec>,
    of_namespace: HashMap<u128, u32>,
}

impl TenantGroups {
    /// The partition of the ACL's namespaces by the set of uids that lists each one.
    /// Groups are numbered from 1 in the order of their smallest namespace, so the
    /// numbering does not depend on the order of the flags.
    pub fn from_acl(acl: &BTreeMap<u32, Vec<u128>>) -> Self {
        let mut readers: BTreeMap<u128, BTreeSet<u32>> = BTreeMap::new();
        for (uid, list) in acl {
            for ns in list {
                readers.entry(*ns).or_default().insert(*uid);
            }
        }
        // BTreeMap over namespaces: each uid set is met first at its smallest namespace.
        let mut by_uids: Vec<(BTreeSet<u32>, Vec<u128>)> = Vec::new();
        for (ns, uids) in readers {
            match by_uids.iter_mut().find(|(u, _)| *u == uids) {
                Some((_, list)) => list.push(ns),
                None => by_uids.push((uids, vec![ns])),
            }
        }
        let mut groups = vec![GroupSpec { uids: Vec::new(), namespaces: Vec::new() }];
        let mut of_namespace = HashMap::new();
        for (uids, namespaces) in by_uids {
            let g = groups.len() as u32;
            of_namespace.extend(namespaces.iter().map(|ns| (*ns, g)));
            groups.push(GroupSpec { uids: uids.into_iter().collect(), namespaces });
        }
        Self { groups, of_namespace }
    }

    /// One group for everything (no ACL).
    pub fn single() -> Self {
        Self::from_acl(&BTreeMap::new())
    }

    pub fn len(&self) -> usize {
        self.groups.len()
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    /// The group whose index and event log hold `namespace`'s objects.
    pub fn group_of(&self, namespace: u128) -> u32 {
        self.of_namespace.get(&namespace).copied().unwrap_or(0)
    }

    pub fn spec(&self, group: u32) -> &GroupSpec {
        &self.groups[group as usize]
    }

    pub fn specs(&self) -> &[GroupSpec] {
        &self.groups
    }

    /// The share of the pool's DRAM the objects of `group` can occupy, which its index is
    /// sized for: `namespace_share` per namespace, capped at 1. Group 0 (any number of
    /// unlisted namespaces) and pools without a quota: 1.
    pub fn index_share(&self, group: u32, namespace_share: f64) -> f64 {
        let n = self.groups[group as usize].namespaces.len();
        if group == 0 || namespace_share >= 1.0 {
            1.0
        } else {
            (namespace_share * n as f64).min(1.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acl(entries: &[(u32, &[u128])]) -> BTreeMap<u32, Vec<u128>> {
        let mut m: BTreeMap<u32, Vec<u128>> = BTreeMap::new();
        for (uid, list) in entries {
            m.entry(*uid).or_default().extend_from_slice(list);
        }
        m
    }

    #[test]
    fn no_acl_is_one_group() {
        let g = TenantGroups::single();
        assert_eq!(g.len(), 1);
        assert_eq!(g.group_of(0), 0);
        assert_eq!(g.group_of(0xabc), 0);
        assert_eq!(g.index_share(0, 0.25), 1.0);
    }

    /// Two tenants with their own namespaces: two groups besides group 0; namespaces not
    /// listed (the pool's own, root's) stay in group 0.
    #[test]
    fn disjoint_tenants_get_their_own_groups() {
        let g = TenantGroups::from_acl(&acl(&[(1001, &[0xa1, 0xa2]), (1002, &[0xb1])]));
        assert_eq!(g.len(), 3);
        assert_eq!(g.group_of(0xa1), g.group_of(0xa2));
        assert_ne!(g.group_of(0xa1), g.group_of(0xb1));
        assert_ne!(g.group_of(0xa1), 0);
        assert_eq!(g.group_of(0xc0), 0, "unlisted");
        assert_eq!(g.spec(g.group_of(0xa1)), &GroupSpec { uids: vec![1001], namespaces: vec![0xa1, 0xa2] });
        assert_eq!(g.spec(g.group_of(0xb1)), &GroupSpec { uids: vec![1002], namespaces: vec![0xb1] });
        // Sized by --namespace-share x its namespaces, capped at 1.
        assert_eq!(g.index_share(g.group_of(0xa1), 0.25), 0.5);
        assert_eq!(g.index_share(g.group_of(0xb1), 0.25), 0.25);
        assert_eq!(g.index_share(g.group_of(0xa1), 0.75), 1.0);
        assert_eq!(g.index_share(0, 0.25), 1.0);
    }

    /// Uids listed for exactly the same namespaces share a group; a namespace shared with
    /// a second uid is split off into a group of its own, so no uid maps an index that
    /// holds a namespace it may not read.
    #[test]
    fn groups_are_namespaces_with_the_same_readers() {
        let g = TenantGroups::from_acl(&acl(&[(1, &[10, 11]), (2, &[10, 11]), (3, &[11, 12]), (4, &[13])]));
        // 10: {1,2}; 11: {1,2,3}; 12: {3}; 13: {4}
        let (g10, g11, g12, g13) = (g.group_of(10), g.group_of(11), g.group_of(12), g.group_of(13));
        assert_eq!(g.len(), 5);
        assert!([g10, g11, g12, g13].iter().all(|&x| x != 0));
        assert_eq!([g10, g11, g12, g13].iter().collect::<BTreeSet<_>>().len(), 4);
        assert_eq!(g.spec(g11).uids, vec![1, 2, 3]);
        for (uid, list) in acl(&[(1, &[10, 11]), (2, &[10, 11]), (3, &[11, 12]), (4, &[13])]) {
            for ns in list {
                let spec = g.spec(g.group_of(ns));
                assert!(spec.uids.contains(&uid));
                // Every namespace of the group is readable by every uid of the group.
                for other in &spec.namespaces {
                    assert_eq!(g.spec(g.group_of(*other)).uids, spec.uids);
                }
            }
        }
    }

    /// The numbering depends on the ACL, not on the order its entries were given in, and
    /// a namespace repeated in one uid's list counts once.
    #[test]
    fn numbering_is_stable() {
        let a = TenantGroups::from_acl(&acl(&[(7, &[0x30, 0x10]), (5, &[0x20])]));
        let b = TenantGroups::from_acl(&acl(&[(5, &[0x20, 0x20]), (7, &[0x10, 0x30, 0x10])]));
        assert_eq!(a, b);
        assert_eq!((a.group_of(0x10), a.group_of(0x30), a.group_of(0x20)), (1, 1, 2));
        assert_eq!(a.spec(1).namespaces, vec![0x10, 0x30]);
    }
}
