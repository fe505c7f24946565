//! The one gate of every test part that needs root (a second uid, chown, setuid programs,
//! huge pages, namespaces): without root it prints "skipped: needs root (...)" and the part
//! is not run, unless [`REQUIRE_ROOT_ENV`] is set (scripts/test.sh sets it: CI runs as
//! root), where a missing root fails the test instead of passing it unobserved.

/// Set (to anything but "0") where the tests run as root: a test that would skip for want
/// of root then fails.
pub const REQUIRE_ROOT_ENV: &str = "UMBP_REQUIRE_ROOT_TESTS";

/// Whether this process runs as root (effective uid 0).
pub fn is_root() -> bool {
    euid() == 0
}

fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// Whether [`REQUIRE_ROOT_ENV`] asks for every root-only part to run.
pub fn root_required() -> bool {
    std::env::var_os(REQUIRE_ROOT_ENV).is_some_and(|v| v != "0" && !v.is_empty())
}

/// True when running as root. Otherwise prints `skipped: needs root (why)` and returns
/// false, or panics when [`REQUIRE_ROOT_ENV`] is set.
pub fn root_or_skip(why: &str) -> bool {
    if is_root() {
        return true;
    }
    assert!(!root_required(), "{REQUIRE_ROOT_ENV} is set but this test runs as uid {}: it needs root ({why})", euid());
    println!("skipped: needs root ({why})");
    false
}

/// For a skip that root alone does not lift (e.g. uid 65534 cannot execute the test binary
/// in this checkout): prints `skipped: why`; under [`REQUIRE_ROOT_ENV`] it fails instead,
/// since CI must observe every root-only part.
pub fn skip_root_part(why: &str) {
    assert!(!root_required(), "{REQUIRE_ROOT_ENV} is set but a root-only part cannot run: {why}");
    println!("skipped: {why}");
}
