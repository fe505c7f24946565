//! The hand-written PTX kernels of the worker child (`spin_fill`, `check_pattern`), loaded
//! at run time by [`super::cu::Gpu`]; nothing here needs nvcc.

/// PTX both kernels share, so the pattern they write and check is one piece of text: a
/// grid-stride loop over word indices `%rd8` (stride `%rd10`) below `%rd2` (nwords),
/// leaving word `%rd8` of pattern `%rd3` (seed; as `super::worker::word`) in `%rd12` and its
/// address in `%rd1` (buf) in `%rd13`. The kernel's own step follows, then
/// `ptx_next_word!`.
macro_rules! ptx_for_each_pattern_word {
    () => {
        r#"    mov.u32 %r1, %ctaid.x;
mov.u32 %r2, %ntid.x;
mov.u32 %r3, %tid.x;
mov.u32 %r4, %nctaid.x;
mul.wide.u32 %rd8, %r1, %r2;
cvt.u64.u32 %rd9, %r3;
add.u64 %rd8, %rd8, %rd9;
mul.wide.u32 %rd10, %r4, %r2;
shl.b64 %rd11, %rd3, 40;
mov.u64 %rd14, 6364136223846793005;
LOOP:
setp.ge.u64 %p2, %rd8, %rd2;
@%p2 bra DONE;
xor.b64 %rd12, %rd8, %rd11;
mul.lo.u64 %rd12, %rd12, %rd14;
add.u64 %rd12, %rd12, %rd3;
shl.b64 %rd13, %rd8, 3;
add.u64 %rd13, %rd1, %rd13;
"#
    };
}

/// Closes `ptx_for_each_pattern_word!` and the kernel.
macro_rules! ptx_next_word {
    () => {
        r#"    add.u64 %rd8, %rd8, %rd10;
bra LOOP;
DONE:
ret;
}
"#
    };
}

/// `spin_fill(buf, nwords, seed, spin_ns)`: every thread spins on %globaltimer for
/// `spin_ns`, then the grid writes the pattern (`super::worker::word`) over `nwords` words.
/// `check_pattern(buf, nwords, seed, bad)`: counts words that differ into `*bad`.
/// Hand-written PTX so nothing here needs nvcc; the driver JIT-compiles it.
pub(crate) const PTX: &str = concat!(
    r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry spin_fill(.param .u64 p_buf, .param .u64 p_n, .param .u64 p_seed, .param .u64 p_spin)
{
.reg .pred %p<3>;
.reg .b32 %r<6>;
.reg .b64 %rd<16>;
ld.param.u64 %rd1, [p_buf];
ld.param.u64 %rd2, [p_n];
ld.param.u64 %rd3, [p_seed];
ld.param.u64 %rd4, [p_spin];
mov.u64 %rd5, %globaltimer;
add.u64 %rd6, %rd5, %rd4;
SPIN:
mov.u64 %rd7, %globaltimer;
setp.lt.u64 %p1, %rd7, %rd6;
@%p1 bra SPIN;
"#,
    ptx_for_each_pattern_word!(),
    r#"    st.global.u64 [%rd13], %rd12;
"#,
    ptx_next_word!(),
    r#"
.visible .entry check_pattern(.param .u64 p_buf, .param .u64 p_n, .param .u64 p_seed, .param .u64 p_bad)
{
.reg .pred %p<4>;
.reg .b32 %r<6>;
.reg .b64 %rd<18>;
ld.param.u64 %rd1, [p_buf];
ld.param.u64 %rd2, [p_n];
ld.param.u64 %rd3, [p_seed];
ld.param.u64 %rd4, [p_bad];
"#,
    ptx_for_each_pattern_word!(),
    r#"    ld.global.u64 %rd15, [%rd13];
setp.ne.u64 %p3, %rd15, %rd12;
@%p3 atom.global.add.u64 %rd16, [%rd4], 1;
"#,
    ptx_next_word!(),
);

