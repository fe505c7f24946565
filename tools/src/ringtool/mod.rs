//! `ringtool`: see inside a live UMBP pool without disturbing it.
//!
//! - `dump`: one report (pool, namespaces, attachments with their rings, index, traffic).
//! - `watch`: the same, refreshed, with per-second rates.
//! - `decode` / `encode`: protocol records (SQE, CQE, Hello, ...) from hex to fields and back.
//! - `inspect`: a ring, index or event-log memfd of a live process, mapped read-only.
//!
//! `dump` and `watch` attach as `Role::Observer`: the pool gives an observer its own
//! (unused) rings and never serves submissions from it, so traffic is unaffected.

pub mod client;
pub mod decode;
pub mod inspect;
pub mod tiers;
pub mod view;

use std::io::{IsTerminal, Read, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use umbp_pool::{PoolReport, Report};

use decode::RecordType;

/// See inside a live UMBP pool: its state, rings, index and events.
///
/// dump and watch attach to the pool's socket as a read-only observer (only to a pool
/// running as this user, root, or $UMBP_POOL_UID: checked before anything is sent); decode
/// and encode work offline on protocol records; inspect maps a memfd of a live process
/// read-only.
#[derive(Parser, Debug)]
#[command(name = "ringtool", version, about, long_about)]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(clap::Args, Debug, Clone)]
pub struct SocketArg {
    /// Pool socket: a path or unix:///path [default: $UMBP_STANDALONE_ADDRESS, else
    /// $XDG_RUNTIME_DIR/umbp/pool.sock or /tmp/umbp/pool.sock, like umbp-pool].
    #[arg(long, value_name = "PATH", value_parser = parse_socket)]
    pub socket: Option<PathBuf>,
}

/// `--socket`: the parser every endpoint reader shares (`umbp_ipc::endpoint`).
fn parse_socket(value: &str) -> Result<PathBuf, String> {
    umbp_ipc::endpoint::parse_endpoint("--socket", std::ffi::OsStr::new(value)).map_err(|e| e.to_string())
}

impl SocketArg {
    /// `--socket`, else `$UMBP_STANDALONE_ADDRESS`, else the default path; an
    /// unparseable variable is an error naming it.
    pub fn path(&self) -> Result<PathBuf, String> {
        match &self.socket {
            Some(s) => Ok(s.clone()),
            None => client::default_socket(),
        }
    }
}

#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Print the pool's state once: capacity and use, namespaces, every attachment (pid,
    /// role, SQ/CQ/hint head/tail, in flight, need_wakeup, errors, registered memory and
    /// devices), the index (occupancy, tombstones, epoch, probe lengths), evictions, events.
    Dump {
        #[command(flatten)]
        socket: SocketArg,
        /// Print the report as one JSON document (the pool's report, as is).
        #[arg(long)]
        json: bool,
    },
    /// Live view of `dump` with per-second rates (stores, loads, bytes, evictions, ...).
    /// Ctrl-C quits.
    Watch {
        #[command(flatten)]
        socket: SocketArg,
        /// Seconds between refreshes.
        #[arg(long, default_value_t = 1.0, value_name = "SECONDS")]
        interval: f64,
        /// Stop after this many refreshes [default: run until Ctrl-C].
        #[arg(long, value_name = "N")]
        count: Option<u64>,
        /// Print one JSON line per refresh (report plus "rates") instead of redrawing the
        /// screen.
        #[arg(long)]
        json: bool,
    },
    /// Decode protocol records from hex (arguments, --file, or stdin) into their fields.
    /// Several consecutive records of the type are decoded in order.
    Decode {
        /// Record type.
        #[arg(long = "type", short = 't', value_enum, value_name = "TYPE")]
        ty: RecordType,
        /// Read raw bytes from this file ("-" = stdin) instead of hex arguments.
        #[arg(long, value_name = "PATH")]
        file: Option<PathBuf>,
        /// Skip this many bytes of the input first.
        #[arg(long, default_value_t = 0, value_name = "BYTES")]
        offset: usize,
        /// Print JSON (one object per record and line) instead of field lists.
        #[arg(long)]
        json: bool,
        /// Hex bytes (spaces, ':' and 0x prefixes allowed). Without them and without
        /// --file, hex is read from stdin.
        hex: Vec<String>,
    },
    /// Encode one record from JSON (as `decode --json` prints it; missing fields are 0)
    /// and print it as hex.
    Encode {
        /// Record type.
        #[arg(long = "type", short = 't', value_enum, value_name = "TYPE")]
        ty: RecordType,
        /// The record as a JSON object.
        json: String,
    },
    /// Inspect a shared region of a live process read-only: give /proc/PID/fd/N of a ring
    /// memfd, an index memfd or an event log memfd (ls -l /proc/PID/fd shows
    /// memfd:umbp-rings-N, memfd:umbp-index, memfd:umbp-events; with tenant groups
    /// umbp-index-gN, umbp-events-gN). The kind is detected from its header.
    Inspect {
        /// The file to map (usually /proc/PID/fd/N).
        #[arg(long, value_name = "PATH")]
        fd: PathBuf,
        /// Event log: list this many of the latest events (each with its tier).
        #[arg(long, default_value_t = 10, value_name = "N")]
        events: usize,
        /// Index: list this many live entries with their tier (dram, ssd, remote) and
        /// location; the per-tier counts always cover every entry.
        #[arg(long, default_value_t = 0, value_name = "N")]
        keys: usize,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Error text of a closed stdout (`ringtool watch | head`): the binary exits quietly.
pub const STDOUT_CLOSED: &str = "stdout closed";

fn stdout_error(e: std::io::Error) -> String {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        STDOUT_CLOSED.into()
    } else {
        format!("stdout: {e}")
    }
}

/// Runs one command; the error text is printed after "ringtool: ".
pub fn run(cli: Cli) -> Result<(), String> {
    let mut stdout = std::io::stdout().lock();
    let mut w = |s: &str| stdout.write_all(s.as_bytes()).map_err(stdout_error);
    match cli.cmd {
        Cmd::Dump { socket, json } => {
            let obs = client::Observer::attach(&socket.path()?)?;
            let report = obs.stats()?;
            if json {
                w(&(serde_json::to_string_pretty(&report).expect("json") + "\n"))
            } else {
                w(&view::dump_any(&report))
            }
        }
        Cmd::Watch { socket, interval, count, json } => watch(&socket.path()?, interval, count, json),
        Cmd::Decode { ty, file, offset, json, hex } => {
            let bytes = read_input(file.as_ref(), &hex)?;
            let bytes = bytes.get(offset..).ok_or_else(|| format!("--offset {offset} is past the {} input bytes", bytes.len()))?;
            let records = decode::decode_all(ty, bytes)?;
            let mut out = String::new();
            for (i, r) in records.iter().enumerate() {
                if json {
                    out.push_str(&serde_json::to_string(r).expect("json"));
                    out.push('\n');
                } else {
                    if records.len() > 1 {
                        out.push_str(&format!("{ty:?} #{i} (offset {})\n", offset + i * ty.size().unwrap_or(0)));
                    }
                    decode::render(r, if records.len() > 1 { 2 } else { 0 }, &mut out);
                }
            }
            w(&out)
        }
        Cmd::Encode { ty, json } => {
            let v: serde_json::Value = serde_json::from_str(&json).map_err(|e| format!("not JSON: {e}"))?;
            let bytes = decode::encode_one(ty, &v)?;
            w(&(decode::hex(&bytes) + "\n"))
        }
        Cmd::Inspect { fd, events, keys, json } => {
            let v = inspect::inspect(&fd, events, keys)?;
            if json {
                w(&(serde_json::to_string_pretty(&v).expect("json") + "\n"))
            } else {
                w(&inspect::render(&v))
            }
        }
    }
}

fn read_input(file: Option<&PathBuf>, hex: &[String]) -> Result<Vec<u8>, String> {
    match file {
        Some(p) if p.as_os_str() == "-" => {
            let mut b = Vec::new();
            std::io::stdin().read_to_end(&mut b).map_err(|e| format!("stdin: {e}"))?;
            Ok(b)
        }
        Some(p) => std::fs::read(p).map_err(|e| format!("{}: {e}", p.display())),
        None if !hex.is_empty() => decode::parse_hex(&hex.join(" ")),
        None => {
            let mut t = String::new();
            std::io::stdin().read_to_string(&mut t).map_err(|e| format!("stdin: {e}"))?;
            decode::parse_hex(&t)
        }
    }
}

fn watch(socket: &std::path::Path, interval: f64, count: Option<u64>, json: bool) -> Result<(), String> {
    if !(interval.is_finite() && interval > 0.0) {
        return Err(format!("--interval {interval}: must be a positive number of seconds"));
    }
    let interval = Duration::from_secs_f64(interval);
    let obs = client::Observer::attach(socket)?;
    let tty = std::io::stdout().is_terminal();
    let mut prev: Option<(PoolReport, Instant)> = None;
    let mut n = 0u64;
    loop {
        let report = match obs.stats().map_err(|e| format!("{e} (the pool went away?)"))? {
            Report::Full(r) => *r,
            Report::Tenant(t) => {
                return Err(format!(
                    "the pool at {} gave the tenant view (uid {}): watch needs the full report; run ringtool as the pool's user or root (`dump` shows the tenant view)",
                    socket.display(),
                    t.uid
                ))
            }
        };
        let now = Instant::now();
        let mut out = std::io::stdout().lock();
        let text = if json {
            let rates: serde_json::Map<_, _> = prev
                .as_ref()
                .map(|(p, t)| view::rates(p, &report, now - *t))
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (k.to_string(), serde_json::json!(v)))
                .collect();
            let mut r = serde_json::to_value(&report).expect("json");
            r["rates"] = serde_json::Value::Object(rates);
            serde_json::to_string(&r).expect("json") + "\n"
        } else {
            let screen = view::watch_screen(&report, prev.as_ref().map(|(p, t)| (p, now - *t)), interval);
            // Clear and home the cursor on a terminal; separate screens with a rule otherwise.
            if tty {
                format!("\x1b[H\x1b[2J{screen}")
            } else {
                format!("{screen}{}\n", "-".repeat(72))
            }
        };
        out.write_all(text.as_bytes()).and_then(|_| out.flush()).map_err(stdout_error)?;
        drop(out);
        prev = Some((report, now));
        n += 1;
        if count.is_some_and(|c| n >= c) {
            return Ok(());
        }
        std::thread::sleep(interval);
    }
}
