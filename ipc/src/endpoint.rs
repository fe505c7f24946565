//! Pool addresses as users write them: a socket path, or `unix://<path>` (the seed's
//! form, e.g. `UMBP_STANDALONE_ADDRESS=unix:///run/umbp/node.sock`). The one parser every
//! reader of an endpoint uses: the daemon's `--socket`, the worker, the scheduler's index
//! client, ringtool and the Python binding, so that all of them accept and refuse the
//! same values with the same message.
//!
//! The pool listens only on unix sockets (memory travels as file descriptors, which TCP
//! cannot carry), so `tcp://...`, any other scheme and a bare `host:port` are refused.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

/// The environment variable that names the pool's address (as in the seed).
pub const ENV_STANDALONE_ADDRESS: &str = "UMBP_STANDALONE_ADDRESS";

/// What to write instead; ends every refusal.
const HINT: &str = "only unix sockets are supported (give a socket path or unix:///path/to/umbp.sock)";

/// A refused endpoint; the message names the key (flag or variable) and the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {message}")]
pub struct EndpointError {
    pub key: String,
    pub message: String,
}

/// `value` (read from `key`, which the error names) -> the socket path it designates.
///
/// - `unix://<path>` -> `<path>` (`unix:///run/umbp/node.sock` -> `/run/umbp/node.sock`);
///   the scheme is matched case-insensitively; an empty path is refused.
/// - `<scheme>://...` for any other scheme -> refused.
/// - a bare `host:port` without a `/` (`localhost:8000`, `[::1]:9000`) -> refused.
/// - anything else is a path, returned unchanged (surrounding whitespace trimmed).
pub fn parse_endpoint(key: &str, value: &OsStr) -> Result<PathBuf, EndpointError> {
    let fail = |message: String| Err(EndpointError { key: key.to_string(), message });
    let bytes = trim(value.as_bytes());
    if bytes.is_empty() {
        return fail(format!("expected a socket path or unix:// address, got {:?}", value));
    }
    let shown = String::from_utf8_lossy(bytes);
    if let Some(sep) = find(bytes, b"://") {
        let scheme = &bytes[..sep];
        if is_scheme(scheme) {
            let rest = &bytes[sep + 3..];
            if !scheme.eq_ignore_ascii_case(b"unix") {
                let scheme = String::from_utf8_lossy(scheme).to_ascii_lowercase();
                return fail(format!("'{shown}' is a {scheme} address; {HINT}"));
            }
            if rest.is_empty() {
                return fail(format!("'{shown}' names no socket path"));
            }
            return Ok(PathBuf::from(OsStr::from_bytes(rest)));
        }
    }
    if !bytes.contains(&b'/') && looks_like_host_port(bytes) {
        return fail(format!("'{shown}' looks like a TCP host:port; {HINT}"));
    }
    Ok(PathBuf::from(OsStr::from_bytes(bytes)))
}

/// The endpoint named by `$UMBP_STANDALONE_ADDRESS` (parsed; the error names the
/// variable), or None where it is unset or empty.
pub fn endpoint_from_env() -> Result<Option<PathBuf>, EndpointError> {
    match std::env::var_os(ENV_STANDALONE_ADDRESS).filter(|v| !v.is_empty()) {
        Some(v) => parse_endpoint(ENV_STANDALONE_ADDRESS, &v).map(Some),
        None => Ok(None),
    }
}

/// The pool's socket when no endpoint is configured: `$UMBP_STANDALONE_ADDRESS` (parsed),
/// else [`crate::default_socket_path`].
pub fn default_endpoint() -> Result<PathBuf, EndpointError> {
    Ok(endpoint_from_env()?.unwrap_or_else(crate::default_socket_path))
}

fn trim(b: &[u8]) -> &[u8] {
    let start = b.iter().position(|c| !c.is_ascii_whitespace()).unwrap_or(b.len());
    let end = b.iter().rposition(|c| !c.is_ascii_whitespace()).map_or(start, |e| e + 1);
    &b[start..end]
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// RFC 3986 scheme: a letter, then letters, digits, `+`, `-`, `.`.
fn is_scheme(s: &[u8]) -> bool {
    matches!(s.first(), Some(c) if c.is_ascii_alphabetic())
        && s.iter().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'+' | b'-' | b'.'))
}

/// `host:port` with a 1-5 digit port and a host of `[A-Za-z0-9_.-]+` or a bracketed IPv6.
fn looks_like_host_port(b: &[u8]) -> bool {
    let Some(colon) = b.iter().rposition(|&c| c == b':') else { return false };
    let (host, port) = (&b[..colon], &b[colon + 1..]);
    if port.is_empty() || port.len() > 5 || !port.iter().all(u8::is_ascii_digit) || host.is_empty() {
        return false;
    }
    if host.first() == Some(&b'[') {
        return host.len() > 2
            && host.last() == Some(&b']')
            && host[1..host.len() - 1].iter().all(|c| c.is_ascii_hexdigit() || matches!(c, b':' | b'.'));
    }
    host.iter().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(v: &str) -> PathBuf {
        parse_endpoint("endpoint", OsStr::new(v)).unwrap()
    }
    fn err(v: &str) -> String {
        parse_endpoint("endpoint", OsStr::new(v)).unwrap_err().to_string()
    }

    #[test]
    fn unix_scheme_is_stripped() {
        assert_eq!(ok("unix:///run/umbp/node.sock"), PathBuf::from("/run/umbp/node.sock"));
        assert_eq!(ok("UNIX:///tmp/a.sock"), PathBuf::from("/tmp/a.sock"));
        assert_eq!(ok(" unix://rel/a.sock "), PathBuf::from("rel/a.sock"));
    }

    #[test]
    fn paths_pass_unchanged() {
        assert_eq!(ok("/run/umbp/pool.sock"), PathBuf::from("/run/umbp/pool.sock"));
        assert_eq!(ok("pool.sock"), PathBuf::from("pool.sock"));
        assert_eq!(ok("./a:1"), PathBuf::from("./a:1"));
        assert_eq!(ok("/tmp/x://y"), PathBuf::from("/tmp/x://y"));
    }

    #[test]
    fn other_schemes_and_host_port_are_refused_with_one_message() {
        let hint = "only unix sockets are supported (give a socket path or unix:///path/to/umbp.sock)";
        for (v, what) in [
            ("tcp://127.0.0.1:5555", "is a tcp address"),
            ("TCP://10.0.0.1:9000", "is a tcp address"),
            ("http://host/x", "is a http address"),
            ("localhost:8000", "looks like a TCP host:port"),
            ("127.0.0.1:5555", "looks like a TCP host:port"),
            ("[::1]:9000", "looks like a TCP host:port"),
        ] {
            let e = err(v);
            assert!(e.starts_with(&format!("endpoint: '{}'", v)), "{e}");
            assert!(e.contains(what) && e.ends_with(hint), "{e}");
        }
        assert!(err("unix://").contains("names no socket path"));
        assert!(err("  ").contains("expected a socket path or unix:// address"));
    }
}
