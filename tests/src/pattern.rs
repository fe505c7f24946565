//! The block pattern: deterministic bytes per object key, so a block loaded under the
//! wrong key, or torn by a racing copy, never verifies.

/// Deterministic contents of the object with `key`: every byte depends on the key and the
/// position, so a block loaded under the wrong key or torn copy never verifies.
pub fn fill_pattern(key: u128, out: &mut [u8]) {
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let w = splitmix(key as u64 ^ (key >> 64) as u64 ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        chunk.copy_from_slice(&w.to_le_bytes()[..chunk.len()]);
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Whether `data` holds the pattern of `key` (see [`fill_pattern`]).
pub fn verify_pattern(key: u128, data: &[u8]) -> bool {
    let mut want = vec![0u8; data.len()];
    fill_pattern(key, &mut want);
    want == data
}
