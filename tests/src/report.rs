//! The report client: asks a pool for its state report ([`umbp_pool::PoolReport`]) through
//! an observer attachment, typed; or for the JSON exactly as sent.

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use umbp_ipc::message::{recv_message, send_message};
use umbp_pool::{PoolReport, Report};
use umbp_protocol::wire::{self, Hello, HelloReply, MessageKind, Reply, Role};

const TIMEOUT: Option<Duration> = Some(Duration::from_secs(5));

/// Attaches to the pool at `socket` as an observer.
pub fn attach_observer(socket: &Path) -> Result<UnixStream, String> {
    let at = |what: &str, e: &dyn std::fmt::Display| format!("pool at {}: {what}: {e}", socket.display());
    let sock = UnixStream::connect(socket).map_err(|e| at("connect", &e))?;
    let hello = Hello::new(Role::Observer, 0, std::process::id());
    send_message(&sock, MessageKind::Hello, bytemuck::bytes_of(&hello), &[], TIMEOUT).map_err(|e| at("Hello", &e))?;
    let m = recv_message(&sock, TIMEOUT).map_err(|e| at("HelloReply", &e))?;
    let r: HelloReply = wire::decode(&m.payload).map_err(|e| at("HelloReply", &e))?;
    if r.status != 0 {
        return Err(at("refused", &r.message()));
    }
    Ok(sock)
}

/// Sends a `StatsRequest` on an attached socket and returns the report's JSON bytes.
pub fn request_report_bytes(sock: &UnixStream) -> Result<Vec<u8>, String> {
    send_message(sock, MessageKind::StatsRequest, &[], &[], TIMEOUT).map_err(|e| format!("StatsRequest: {e}"))?;
    let m = recv_message(sock, TIMEOUT).map_err(|e| format!("waiting for the report: {e}"))?;
    let r: Reply = wire::decode(&m.payload).map_err(|e| format!("bad Reply: {e}"))?;
    if r.status != 0 {
        return Err(format!("StatsRequest refused: {}", r.message()));
    }
    Ok(m.payload[std::mem::size_of::<Reply>()..].to_vec())
}

/// Parses report JSON: the full report or the tenant view.
pub fn parse_report(json: &[u8]) -> Result<Report, String> {
    serde_json::from_slice(json).map_err(|e| format!("not a pool report: {e}: {}", String::from_utf8_lossy(json)))
}

/// Parses report JSON that must be the full report.
pub fn parse_full_report(json: &[u8]) -> Result<PoolReport, String> {
    parse_report(json)?.into_full().map_err(|t| format!("got the tenant view (uid {}), not the full report", t.uid))
}

/// The report of the pool at `socket`, either kind.
pub fn try_report(socket: &Path) -> Result<Report, String> {
    parse_report(&request_report_bytes(&attach_observer(socket)?)?)
}

/// The full report of the pool at `socket`; panics with the reason when there is none.
pub fn report(socket: &Path) -> PoolReport {
    let bytes = attach_observer(socket).and_then(|s| request_report_bytes(&s)).unwrap_or_else(|e| panic!("report: {e}"));
    parse_full_report(&bytes).unwrap_or_else(|e| panic!("report from {}: {e}", socket.display()))
}

/// The report of the pool at `socket` as JSON, exactly as sent (for wire-form checks).
pub fn report_json(socket: &Path) -> serde_json::Value {
    let bytes = attach_observer(socket).and_then(|s| request_report_bytes(&s)).unwrap_or_else(|e| panic!("report: {e}"));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("report from {} is not JSON: {e}", socket.display()))
}
