//! A minimal client of etcd's v3 JSON gateway (`POST /v3/...`, keys and values base64):
//! blocking HTTP/1.1 over `std::net`, one request per connection, every step bounded by a
//! timeout, so an etcd that is down or hung costs the caller at most that timeout.
//!
//! Why not the `etcd-client` crate: it brings tonic, prost and a tokio runtime into a
//! crate that has none, for five unary calls (grant, keep-alive, put, range, revoke).

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use serde_json::Value;

/// Largest response body read (a range over the members prefix: ~100 B per member).
const MAX_RESPONSE: usize = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("etcd endpoint {0:?}: only http://HOST:PORT is supported (put TLS in a local proxy)")]
    BadUrl(String),
    #[error("etcd at {endpoint}: {what}")]
    Io { endpoint: String, what: String },
    #[error("etcd at {endpoint} answered {status}: {body}")]
    Status { endpoint: String, status: u16, body: String },
}

/// The endpoints of one etcd cluster; a request tries the last one that answered first.
#[derive(Debug)]
pub struct Gateway {
    endpoints: Vec<String>,
    current: usize,
    timeout: Duration,
}

impl Gateway {
    /// `urls`: `http://HOST:PORT` each (a trailing `/` allowed).
    pub fn new(urls: &[String], timeout: Duration) -> Result<Self, GatewayError> {
        let mut endpoints = Vec::new();
        for u in urls {
            let hp = u.trim().strip_prefix("http://").ok_or_else(|| GatewayError::BadUrl(u.clone()))?.trim_end_matches('/');
            if hp.is_empty() || hp.contains('/') || !hp.contains(':') {
                return Err(GatewayError::BadUrl(u.clone()));
            }
            endpoints.push(hp.to_string());
        }
        if endpoints.is_empty() {
            return Err(GatewayError::BadUrl(String::new()));
        }
        Ok(Self { endpoints, current: 0, timeout })
    }

    /// POSTs `body` to `path` (e.g. `/v3/kv/range`) at the first endpoint that answers;
    /// the JSON answer. A streaming call's single answer comes wrapped in `result`.
    pub fn call(&mut self, path: &str, body: &Value) -> Result<Value, GatewayError> {
        let mut last = None;
        for i in 0..self.endpoints.len() {
            let at = (self.current + i) % self.endpoints.len();
            match post(&self.endpoints[at], path, &body.to_string(), self.timeout) {
                Ok(v) => {
                    self.current = at;
                    return Ok(v);
                }
                Err(e @ GatewayError::Status { .. }) => return Err(e),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("at least one endpoint"))
    }
}

fn post(endpoint: &str, path: &str, body: &str, timeout: Duration) -> Result<Value, GatewayError> {
    let io = |what: String| GatewayError::Io { endpoint: endpoint.to_string(), what };
    let addr =
        endpoint.to_socket_addrs().map_err(|e| io(format!("resolve: {e}")))?.next().ok_or_else(|| io("resolves to no address".into()))?;
    let mut s = TcpStream::connect_timeout(&addr, timeout).map_err(|e| io(format!("connect: {e}")))?;
    s.set_read_timeout(Some(timeout)).and_then(|()| s.set_write_timeout(Some(timeout))).map_err(|e| io(e.to_string()))?;
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: {endpoint}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).map_err(|e| io(format!("write: {e}")))?;
    let mut raw = Vec::new();
    s.take(MAX_RESPONSE as u64 + 4096).read_to_end(&mut raw).map_err(|e| io(format!("read: {e}")))?;
    let (status, chunked, body) = split_response(&raw).ok_or_else(|| io("not an HTTP response".into()))?;
    let body = if chunked { dechunk(body).ok_or_else(|| io("bad chunked body".into()))? } else { body.to_vec() };
    if status != 200 {
        return Err(GatewayError::Status {
            endpoint: endpoint.to_string(),
            status,
            body: String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned(),
        });
    }
    serde_json::from_slice(&body).map_err(|e| io(format!("answer is not JSON: {e}")))
}

/// (status, chunked?, body) of a whole HTTP/1.1 response.
fn split_response(raw: &[u8]) -> Option<(u16, bool, &[u8])> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..end]).ok()?;
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let chunked = lines.any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    Some((status, chunked, &raw[end + 4..]))
}

/// The payload of a chunked body (a stream that ended early gives what arrived whole).
fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let nl = b.windows(2).position(|w| w == b"\r\n")?;
        let size_field = std::str::from_utf8(&b[..nl]).ok()?.split(';').next()?.trim();
        let n = usize::from_str_radix(size_field, 16).ok()?;
        b = &b[nl + 2..];
        if n == 0 || b.len() < n {
            return Some(out);
        }
        out.extend_from_slice(&b[..n]);
        b = b.get(n + 2..).unwrap_or(&[]);
        if b.is_empty() {
            return Some(out);
        }
    }
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding (the gateway's encoding of `bytes` fields).
pub fn b64(data: &[u8]) -> String {
    let mut s = String::with_capacity(data.len().div_ceil(3) * 4);
    for c in data.chunks(3) {
        let n = (u32::from(c[0]) << 16) | (u32::from(*c.get(1).unwrap_or(&0)) << 8) | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                s.push(B64[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}

/// Decodes standard base64 (padding optional); None on any other character.
pub fn unb64(s: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    let (mut acc, mut bits) = (0u32, 0u32);
    for ch in s.bytes().filter(|&c| c != b'=') {
        let v = B64.iter().position(|&b| b == ch)? as u32;
        acc = (acc << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    Some(out)
}

/// The gateway writes 64-bit integers as JSON strings; either form is read.
pub fn int(v: &Value) -> Option<i64> {
    v.as_i64().or_else(|| v.as_str()?.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips_and_matches_the_etcd_docs_example() {
        assert_eq!(b64(b"foo"), "Zm9v");
        assert_eq!(b64(b"fo"), "Zm8=");
        assert_eq!(b64(b"f"), "Zg==");
        for n in 0..40u8 {
            let d: Vec<u8> = (0..n).map(|i| i.wrapping_mul(37)).collect();
            assert_eq!(unb64(&b64(&d)).unwrap(), d);
        }
        assert!(unb64("Zm9v!").is_none());
    }

    #[test]
    fn chunked_bodies_and_status_lines_are_parsed() {
        let raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"a\"\r\n3\r\n:1}\r\n0\r\n\r\n";
        let (st, ch, body) = split_response(raw).unwrap();
        assert_eq!((st, ch), (200, true));
        assert_eq!(dechunk(body).unwrap(), b"{\"a\":1}");
        assert!(Gateway::new(&["https://x:1".into()], Duration::from_secs(1)).is_err());
        assert!(Gateway::new(&["http://127.0.0.1:2379/".into()], Duration::from_secs(1)).is_ok());
        assert_eq!(int(&Value::String("7587".into())), Some(7587));
    }
}
