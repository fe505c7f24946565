//! What an index entry's `location` word says: which tier holds the object and where in
//! it. Schedulers only need "present"; the tier is for tools, metrics, KV events (vLLM's
//! events carry a medium) and for the pool itself, which promotes on a load.
//!
//! ```text
//!  63    60 59                                                        0
//! ┌────────┬───────────────────────────────────────────────────────────┐
//! │  tier  │ payload (DRAM: byte offset; SSD: pool's own handle; ...)  │
//! └────────┴───────────────────────────────────────────────────────────┘
//! ```
//! Tier 0 is DRAM, so every location written before tiers existed (a bare DRAM offset)
//! decodes unchanged.

/// Storage tier of an object, slowest last.
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// Pool DRAM (pinned): a load copies straight to the GPU.
    Dram = 0,
    /// The pool's SSD tier: a load first promotes the object to DRAM.
    Ssd = 1,
    /// Another node's pool: a load first pulls the object over the cluster transport.
    Remote = 2,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Dram, Tier::Ssd, Tier::Remote];

    pub fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Self::Dram),
            1 => Some(Self::Ssd),
            2 => Some(Self::Remote),
            _ => None,
        }
    }

    /// Lower-case name, as tools, metrics labels and KV events spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Dram => "dram",
            Self::Ssd => "ssd",
            Self::Remote => "remote",
        }
    }
}

const TIER_SHIFT: u32 = 60;
/// Largest payload a location can carry (2^60 - 1).
pub const MAX_PAYLOAD: u64 = (1 << TIER_SHIFT) - 1;

/// Packs a tier and a payload into an index location word.
pub fn encode(tier: Tier, payload: u64) -> u64 {
    debug_assert!(payload <= MAX_PAYLOAD, "location payload {payload:#x} past 60 bits");
    ((tier as u64) << TIER_SHIFT) | (payload & MAX_PAYLOAD)
}

/// The tier and payload of a location word; None for a tier this build does not know
/// (a newer pool): callers treat the object as present but not loadable from here.
pub fn decode(location: u64) -> Option<(Tier, u64)> {
    Tier::from_u8((location >> TIER_SHIFT) as u8).map(|t| (t, location & MAX_PAYLOAD))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_tier_and_keeps_bare_dram_offsets() {
        for t in Tier::ALL {
            for p in [0, 1, 4096, MAX_PAYLOAD] {
                assert_eq!(decode(encode(t, p)), Some((t, p)));
            }
        }
        assert_eq!(decode(1 << 40), Some((Tier::Dram, 1 << 40)), "pre-tier locations are DRAM offsets");
        assert_eq!(decode(15 << 60), None);
    }
}
