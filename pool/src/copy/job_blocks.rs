//! A submission's blocks on their way through a copy thread: candidates (need a copy) and
//! blocks whose object is reserved or pinned. Plain data, below everything that moves them.

use umbp_protocol::ObjectKey;

use crate::store::objects::GroupKey;

/// A block of a submission that needs a copy, before its object is reserved.
#[derive(Clone, Copy)]
pub struct Candidate {
    /// Position in the submission (and in `statuses`).
    pub index: usize,
    pub key: ObjectKey,
    pub block_id: u64,
}

/// A block whose object is reserved (store) or pinned (load) for the copy.
pub struct JobBlock {
    /// Position in the submission (and in `statuses`).
    pub index: usize,
    pub key: ObjectKey,
    /// The submitter's tenant group: the object is (group, key) in the store.
    pub group: u32,
    pub block_id: u64,
    /// Object offset in DRAM.
    pub offset: u64,
}

impl JobBlock {
    pub(crate) fn object(&self) -> GroupKey {
        GroupKey::new(self.group, self.key)
    }
}
