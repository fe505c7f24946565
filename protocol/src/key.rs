//! Object keys: xxh3-128 over (namespace, cache group, rank, vLLM block hash bytes).

use xxhash_rust::xxh3::xxh3_128;

/// 128-bit identity of one object (one block of one rank of one cache group).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey(pub u128);

impl ObjectKey {
    /// Key of one block. The namespace carries model, layout and topology identity,
    /// because vLLM's block hashes carry none.
    pub fn derive(namespace: u128, group: u32, rank: u32, block_hash: &[u8]) -> Self {
        let mut buf = Vec::with_capacity(24 + block_hash.len());
        buf.extend_from_slice(&namespace.to_le_bytes());
        buf.extend_from_slice(&group.to_le_bytes());
        buf.extend_from_slice(&rank.to_le_bytes());
        buf.extend_from_slice(block_hash);
        Self(xxh3_128(&buf))
    }

    pub fn to_words(self) -> [u64; 2] {
        [self.0 as u64, (self.0 >> 64) as u64]
    }

    pub fn from_words(w: [u64; 2]) -> Self {
        Self(w[0] as u128 | (w[1] as u128) << 64)
    }

    pub fn to_bytes(self) -> [u8; 16] {
        self.0.to_le_bytes()
    }

    pub fn from_bytes(b: [u8; 16]) -> Self {
        Self(u128::from_le_bytes(b))
    }
}

/// Namespace digest of a canonical description string (model, dtype, layout, topology).
pub fn namespace_digest(canonical: &str) -> u128 {
    xxh3_128(canonical.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_component_changes_the_key() {
        let base = ObjectKey::derive(1, 0, 0, b"hash");
        assert_ne!(base, ObjectKey::derive(2, 0, 0, b"hash"));
        assert_ne!(base, ObjectKey::derive(1, 1, 0, b"hash"));
        assert_ne!(base, ObjectKey::derive(1, 0, 1, b"hash"));
        assert_ne!(base, ObjectKey::derive(1, 0, 0, b"hasH"));
        assert_eq!(base, ObjectKey::derive(1, 0, 0, b"hash"));
        assert_eq!(ObjectKey::from_words(base.to_words()), base);
        assert_eq!(ObjectKey::from_bytes(base.to_bytes()), base);
    }
}
