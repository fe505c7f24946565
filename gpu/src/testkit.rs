//! Test kernels shared by the GPU tests of this crate (`gpu/tests/cuda_gather.rs`) and the
//! worker child of `umbp-bench transfer --check`: hand-written PTX (nothing needs nvcc; the
//! driver JIT-compiles it) that writes and checks one pattern, so a test can tell bytes a
//! kernel wrote from bytes copied before it ran. Not part of the pool's API.

/// Word `i` (8 bytes, little endian) of pattern `seed`, as the kernels of [`PTX`] compute it.
pub fn pattern_word(seed: u64, i: u64) -> u64 {
    (i ^ (seed << 40)).wrapping_mul(0x5851_F42D_4C95_7F2D).wrapping_add(seed)
}

/// Opens a kernel of [`PTX`]: `name(buf, nwords, seed, last)`, parameters in `%rd1..%rd4`.
macro_rules! ptx_kernel {
    ($name:literal, $last:literal) => {
        concat!(
            ".visible .entry ",
            $name,
            "(.param .u64 p_buf, .param .u64 p_n, .param .u64 p_seed, .param .u64 ",
            $last,
            ")\n{\n",
            ".reg .pred %p<4>;\n.reg .b32 %r<6>;\n.reg .b64 %rd<18>;\n",
            "ld.param.u64 %rd1, [p_buf];\nld.param.u64 %rd2, [p_n];\nld.param.u64 %rd3, [p_seed];\nld.param.u64 %rd4, [",
            $last,
            "];\n"
        )
    };
}

/// A grid-stride loop over word indices `%rd8` (stride `%rd10`) below `%rd2` (nwords),
/// leaving word `%rd8` of pattern `%rd3` (seed; as [`pattern_word`]) in `%rd12` and its
/// address in `%rd1` (buf) in `%rd13`; then `$step` (the kernel's own work on that word),
/// the next word, and the end of the kernel.
macro_rules! ptx_for_each_pattern_word {
    ($step:literal) => {
        concat!(
            "mov.u32 %r1, %ctaid.x;\nmov.u32 %r2, %ntid.x;\nmov.u32 %r3, %tid.x;\nmov.u32 %r4, %nctaid.x;\n",
            "mul.wide.u32 %rd8, %r1, %r2;\ncvt.u64.u32 %rd9, %r3;\nadd.u64 %rd8, %rd8, %rd9;\nmul.wide.u32 %rd10, %r4, %r2;\n",
            "shl.b64 %rd11, %rd3, 40;\nmov.u64 %rd14, 6364136223846793005;\n",
            "LOOP:\nsetp.ge.u64 %p2, %rd8, %rd2;\n@%p2 bra DONE;\n",
            "xor.b64 %rd12, %rd8, %rd11;\nmul.lo.u64 %rd12, %rd12, %rd14;\nadd.u64 %rd12, %rd12, %rd3;\n",
            "shl.b64 %rd13, %rd8, 3;\nadd.u64 %rd13, %rd1, %rd13;\n",
            $step,
            "add.u64 %rd8, %rd8, %rd10;\nbra LOOP;\nDONE:\nret;\n}\n"
        )
    };
}

/// `spin_fill(buf, nwords, seed, spin_ns)`: every thread spins on `%globaltimer` for
/// `spin_ns`, then the grid writes pattern `seed` ([`pattern_word`]) over `nwords` words.
/// `check_pattern(buf, nwords, seed, bad)`: adds the count of words that differ from the
/// pattern to the u64 at `bad` (device-accessible).
pub const PTX: &str = concat!(
    ".version 7.0\n.target sm_70\n.address_size 64\n\n",
    ptx_kernel!("spin_fill", "p_spin"),
    "mov.u64 %rd5, %globaltimer;\nadd.u64 %rd6, %rd5, %rd4;\n",
    "SPIN:\nmov.u64 %rd7, %globaltimer;\nsetp.lt.u64 %p1, %rd7, %rd6;\n@%p1 bra SPIN;\n",
    ptx_for_each_pattern_word!("st.global.u64 [%rd13], %rd12;\n"),
    ptx_kernel!("check_pattern", "p_bad"),
    ptx_for_each_pattern_word!(
        "ld.global.u64 %rd15, [%rd13];\nsetp.ne.u64 %p3, %rd15, %rd12;\n@%p3 atom.global.add.u64 %rd16, [%rd4], 1;\n"
    ),
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_kernels_are_whole_entries() {
        assert_eq!(PTX.matches(".visible .entry ").count(), 2);
        assert_eq!(PTX.matches('{').count(), PTX.matches('}').count());
        assert_eq!(PTX.matches("\nret;\n}").count(), 2);
        assert!(PTX.contains("spin_fill(") && PTX.contains("check_pattern("));
        // The multiplier in the PTX is pattern_word's.
        assert!(PTX.contains(&0x5851_F42D_4C95_7F2Du64.to_string()));
        assert_eq!(pattern_word(0, 1), 0x5851_F42D_4C95_7F2D);
    }
}
