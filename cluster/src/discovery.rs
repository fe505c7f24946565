//! `Discovery` implementations beyond the static list (`membership::StaticPeers`): etcd
//! (`etcd`: registration under a lease, the members prefix read) over a minimal client
//! of etcd's v3 JSON gateway (`gateway`).

pub mod etcd;
pub mod gateway;
