//! `umbp._native`: the Python face of UMBP. Thin wrappers: every blocking call releases
//! the GIL, every error becomes `UmbpError` with the Rust error's message (which names
//! the socket path, key or field at fault).

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::PyBytes;
use umbp_protocol::entries::BlockStatus;
use umbp_protocol::layout::Segment;
use umbp_protocol::ObjectKey;

pyo3::create_exception!(_native, UmbpError, pyo3::exceptions::PyRuntimeError, "An error from the UMBP pool or its clients.");

fn err(e: impl std::fmt::Display) -> PyErr {
    UmbpError::new_err(e.to_string())
}

fn key16(b: &[u8], what: &str) -> PyResult<[u8; 16]> {
    b.try_into().map_err(|_| PyValueError::new_err(format!("{what} must be 16 bytes, got {}", b.len())))
}

fn keys_of(keys: Vec<Vec<u8>>) -> PyResult<Vec<ObjectKey>> {
    keys.iter().map(|k| key16(k, "key").map(ObjectKey::from_bytes)).collect()
}

/// xxh3-128 key of one block: (namespace, cache group, rank, vLLM block hash bytes).
#[pyfunction]
fn object_key<'py>(py: Python<'py>, namespace: &[u8], group: u32, rank: u32, block_hash: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    let ns = u128::from_le_bytes(key16(namespace, "namespace")?);
    Ok(PyBytes::new(py, &ObjectKey::derive(ns, group, rank, block_hash).to_bytes()))
}

/// Keys of many blocks at once (one call per request instead of one per block).
#[pyfunction]
fn object_keys<'py>(
    py: Python<'py>,
    namespace: &[u8],
    group: u32,
    rank: u32,
    block_hashes: Vec<PyBackedBytes>,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let ns = u128::from_le_bytes(key16(namespace, "namespace")?);
    Ok(block_hashes.iter().map(|h| PyBytes::new(py, &ObjectKey::derive(ns, group, rank, h.as_ref()).to_bytes())).collect())
}

/// 16-byte digest of a canonical description (model, dtype, layout, topology).
#[pyfunction]
fn namespace_digest<'py>(py: Python<'py>, text: &str) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &umbp_protocol::key::namespace_digest(text).to_le_bytes())
}

/// The pool's socket when none is configured: `$UMBP_STANDALONE_ADDRESS` (a path or
/// `unix://` address), else the default path. ValueError names the variable if it is
/// not a unix socket address.
#[pyfunction]
fn default_socket_path() -> PyResult<String> {
    umbp_worker::default_endpoint().map(|p| p.display().to_string()).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// A pool address -> its socket path: a path, or `unix://<path>`; `tcp://`, any other
/// scheme and a bare `host:port` raise ValueError naming `key`. The same parser as
/// umbp-pool's `--socket`, the Rust worker and scheduler, and ringtool.
#[pyfunction]
fn parse_endpoint(key: &str, value: &str) -> PyResult<String> {
    umbp_ipc::endpoint::parse_endpoint(key, std::ffi::OsStr::new(value))
        .map(|p| p.display().to_string())
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// Parses `64GiB`-style sizes exactly like umbp-pool does; errors name `key`.
#[pyfunction]
fn parse_size(key: &str, value: &str) -> PyResult<u64> {
    umbp_pool::parse_size(key, value).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// Routes Rust `tracing` logs to stderr, filtered by RUST_LOG (default warn). Idempotent.
#[pyfunction]
fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .try_init();
}

/// A pool running inside this process (embedded mode). It listens on a socket so that
/// workers and the engine's scheduler (often another process) attach the same way as to
/// a standalone pool.
#[pyclass(module = "umbp._native")]
struct EmbeddedPool {
    pool: Mutex<Option<umbp_pool::Pool>>,
    socket_path: String,
}

#[pymethods]
impl EmbeddedPool {
    #[new]
    /// The keyword arguments are rows of the pool's settings table (`pool_settings()`):
    /// None takes the table's default, as umbp-pool does for a flag left out. `hugepages`,
    /// `numa_node`, `prefault` and `copy_threads` are umbp-pool's `--hugepages`,
    /// `--numa-node`, `--prefault` and `--copy-threads`; with `copy_threads` one attachment
    /// (this worker) may use all of them. `ssd_dir` (one directory per drive, each existing
    /// and writable, held by this pool alone) turns on the SSD tier below DRAM; the other
    /// `ssd_*` are umbp-pool's `--ssd-*` flags (sizes in bytes, `ssd_flush_on_stop` in
    /// seconds). A bad value raises ValueError naming the keyword.
    #[pyo3(signature = (capacity_bytes, socket_path=None, high_wm=None, low_wm=None, min_object_bytes=None, hugepages=None, numa_node=None, prefault=None, copy_threads=None, ssd_dir=None, ssd_capacity=None, ssd_high_wm=None, ssd_low_wm=None, ssd_direct_io=None, ssd_admission=None, ssd_segment_bytes=None, ssd_flush_on_stop=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        capacity_bytes: u64,
        socket_path: Option<String>,
        high_wm: Option<f64>,
        low_wm: Option<f64>,
        min_object_bytes: Option<u64>,
        hugepages: Option<bool>,
        numa_node: Option<u32>,
        prefault: Option<bool>,
        copy_threads: Option<usize>,
        ssd_dir: Option<Vec<String>>,
        ssd_capacity: Option<u64>,
        ssd_high_wm: Option<f64>,
        ssd_low_wm: Option<f64>,
        ssd_direct_io: Option<bool>,
        ssd_admission: Option<String>,
        ssd_segment_bytes: Option<u64>,
        ssd_flush_on_stop: Option<f64>,
    ) -> PyResult<Self> {
        let mut cfg = umbp_pool::PoolConfig { capacity_bytes, numa_node, ..Default::default() };
        cfg.high_watermark = high_wm.unwrap_or(cfg.high_watermark);
        cfg.low_watermark = low_wm.unwrap_or(cfg.low_watermark);
        cfg.hugepages = hugepages.unwrap_or(cfg.hugepages);
        cfg.prefault = prefault.unwrap_or(cfg.prefault);
        cfg.min_object_bytes = min_object_bytes.unwrap_or(cfg.min_object_bytes);
        let opts = SsdArgs {
            dirs: ssd_dir.unwrap_or_default(),
            capacity: ssd_capacity,
            high_wm: ssd_high_wm,
            low_wm: ssd_low_wm,
            direct_io: ssd_direct_io,
            admission: ssd_admission,
            segment_bytes: ssd_segment_bytes,
            flush_on_stop: ssd_flush_on_stop,
        };
        cfg.ssd = ssd_config(opts)?;
        if let Some(n) = copy_threads {
            cfg.copy_threads = n;
            cfg.copy_threads_per_peer = n;
        }
        cfg.socket_path = match socket_path {
            Some(p) => PathBuf::from(p),
            None => {
                let dir = umbp_ipc_default_dir();
                dir.join(format!("embedded-{}-{}.sock", std::process::id(), next_embedded_id()))
            }
        };
        cfg.validate().map_err(|e| PyValueError::new_err(e.naming_keyword()))?;
        let path = cfg.socket_path.display().to_string();
        let pool = py.detach(|| umbp_pool::Pool::start(cfg)).map_err(err)?;
        Ok(Self { pool: Mutex::new(Some(pool)), socket_path: path })
    }

    #[getter]
    fn socket_path(&self) -> String {
        self.socket_path.clone()
    }

    /// The pool's state report as a JSON string.
    fn report(&self) -> PyResult<String> {
        let g = self.pool.lock().expect("pool lock");
        let p = g.as_ref().ok_or_else(|| err("pool is closed"))?;
        serde_json::to_string(&p.report()).map_err(|e| err(format!("report: {e}")))
    }

    /// Keys stored ("stored") or removed ("removed", evictions included) since the last call.
    fn take_events<'py>(&self, py: Python<'py>) -> Vec<(String, Bound<'py, PyBytes>)> {
        let g = self.pool.lock().expect("pool lock");
        let Some(p) = g.as_ref() else { return Vec::new() };
        p.take_events()
            .into_iter()
            .map(|e| match e {
                umbp_pool::ObjectEvent::Stored(k) => ("stored".to_string(), PyBytes::new(py, &k.to_bytes())),
                umbp_pool::ObjectEvent::Removed(k) => ("removed".to_string(), PyBytes::new(py, &k.to_bytes())),
            })
            .collect()
    }

    fn close(&self, py: Python<'_>) {
        let p = self.pool.lock().expect("pool lock").take();
        if let Some(p) = p {
            py.detach(|| p.shutdown());
        }
    }
}

/// The embedded pool's `ssd_*` arguments.
struct SsdArgs {
    dirs: Vec<String>,
    capacity: Option<u64>,
    high_wm: Option<f64>,
    low_wm: Option<f64>,
    direct_io: Option<bool>,
    admission: Option<String>,
    segment_bytes: Option<u64>,
    /// Seconds the pool may spend writing DRAM objects to SSD when it stops (0: off).
    flush_on_stop: Option<f64>,
}

/// The SSD tier's config from the `ssd_*` arguments; None without a directory. Unset values
/// follow the pool's rules (`SsdSettings::resolve`); `PoolConfig::validate` checks the rest.
fn ssd_config(a: SsdArgs) -> PyResult<Option<umbp_ssd::SsdConfig>> {
    let bad = |msg: String| PyValueError::new_err(msg);
    let dirs: Vec<PathBuf> = a.dirs.iter().filter(|d| !d.trim().is_empty()).map(PathBuf::from).collect();
    if dirs.is_empty() {
        if a.capacity.is_some() || a.admission.is_some() || a.segment_bytes.is_some() || a.flush_on_stop.is_some() {
            return Err(bad("ssd_capacity, ssd_admission, ssd_segment_bytes, ssd_flush_on_stop: no effect without ssd_dir".into()));
        }
        return Ok(None);
    }
    let admission =
        a.admission.as_deref().map(|p| umbp_ssd::SsdAdmission::parse("ssd_admission", p)).transpose().map_err(|e| bad(e.to_string()))?;
    let flush_on_stop = a
        .flush_on_stop
        .map(|secs| match Duration::try_from_secs_f64(secs) {
            Ok(d) if d <= Duration::from_secs(86_400) => Ok(d),
            _ => Err(bad(format!("ssd_flush_on_stop: expected seconds in [0, 86400], got {secs}"))),
        })
        .transpose()?;
    let settings = umbp_pool::config::SsdSettings {
        dirs,
        capacity_bytes: a.capacity,
        high_watermark: a.high_wm,
        low_watermark: a.low_wm,
        direct_io: a.direct_io,
        admission,
        segment_bytes: a.segment_bytes,
        queue_depth: None,
        flush_on_stop,
        sync_interval: None,
    };
    settings.resolve().map_err(|e| bad(e.naming_keyword()))
}

/// The pool's settings table, one dict per setting: `name` (the `EmbeddedPool` keyword),
/// `kind`, `default` (a string as umbp-pool's flag takes it; None: unset, `help` says what
/// that means), `env`, `flag` (umbp-pool's, without dashes), `help`. `umbp.vllm.config`
/// reads its defaults from here.
#[pyfunction]
fn pool_settings<'py>(py: Python<'py>) -> PyResult<Vec<Bound<'py, pyo3::types::PyDict>>> {
    umbp_pool::config::settings::ALL
        .iter()
        .map(|s| {
            let d = pyo3::types::PyDict::new(py);
            d.set_item("name", s.name)?;
            d.set_item("kind", s.kind)?;
            d.set_item("default", s.default)?;
            d.set_item("env", s.env)?;
            d.set_item("flag", s.flag)?;
            d.set_item("help", s.help)?;
            Ok(d)
        })
        .collect()
}

fn umbp_ipc_default_dir() -> PathBuf {
    let p = umbp_worker::default_endpoint().unwrap_or_else(|_| umbp_ipc::default_socket_path());
    p.parent().map(|d| d.to_path_buf()).unwrap_or_else(std::env::temp_dir)
}

fn next_embedded_id() -> u64 {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// An engine worker's attachment: register memory and layouts, submit stores and loads,
/// reap completions. Reconnects to a restarted pool by itself.
#[pyclass(module = "umbp._native")]
struct Worker {
    inner: Mutex<Option<umbp_worker::Worker>>,
}

impl Worker {
    fn with<T>(&self, py: Python<'_>, f: impl FnOnce(&mut umbp_worker::Worker) -> Result<T, umbp_worker::WorkerError> + Send) -> PyResult<T>
    where
        T: Send,
    {
        py.detach(|| {
            let mut g = self.inner.lock().expect("worker lock");
            let w = g.as_mut().ok_or(umbp_worker::WorkerError::Invalid("worker is closed".into()))?;
            f(w)
        })
        .map_err(err)
    }
}

// u32, not u8: pyo3 turns Vec<u8> into `bytes`; callers want a list of ints.
fn statuses(s: &[BlockStatus]) -> Vec<u32> {
    s.iter().map(|b| *b as u32).collect()
}

#[pymethods]
impl Worker {
    #[new]
    /// `pool_uid`: a uid accepted as the pool's besides this process's own and root (the
    /// pool's service user); None: `UMBP_POOL_UID`.
    #[pyo3(signature = (endpoint, namespace, tp_rank=0, tp_size=1, dp_rank=0, timeout_ms=5000, startup_timeout_ms=10000, pool_uid=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        endpoint: String,
        namespace: &[u8],
        tp_rank: u32,
        tp_size: u32,
        dp_rank: u32,
        timeout_ms: u64,
        startup_timeout_ms: u64,
        pool_uid: Option<u32>,
    ) -> PyResult<Self> {
        let ns = u128::from_le_bytes(key16(namespace, "namespace")?);
        let endpoint = parse_endpoint("endpoint", &endpoint)?;
        let mut cfg = umbp_worker::WorkerConfig::new(endpoint, ns);
        cfg.tp_rank = tp_rank;
        cfg.tp_size = tp_size;
        cfg.dp_rank = dp_rank;
        cfg.timeout = Duration::from_millis(timeout_ms);
        cfg.startup_timeout = Duration::from_millis(startup_timeout_ms);
        cfg.pool_uid = pool_uid;
        let w = py.detach(|| umbp_worker::Worker::connect(cfg)).map_err(err)?;
        Ok(Self { inner: Mutex::new(Some(w)) })
    }

    /// Registers `size` bytes at `ptr` of this process (CPU tensors); returns the alloc id.
    ///
    /// The caller vouches (Python cannot express it) that the range is one live allocation
    /// that stays allocated until this Worker is closed, and is not used by anything else
    /// while a transfer into or out of it is in flight (`Worker::register_memory`'s
    /// contract): the vLLM connector registers its KV cache tensors, which live as long
    /// as the engine.
    fn register_host_memory(&self, py: Python<'_>, ptr: usize, size: usize) -> PyResult<u32> {
        // SAFETY: the Python caller vouches for the range, as documented above.
        self.with(py, |w| unsafe { w.register_memory(umbp_worker::MemorySpec::HostProcess { ptr, len: size }) })
    }

    /// Registers a CUDA device allocation range (exported with an IPC handle). The caller
    /// vouches that it stays allocated until this Worker is closed.
    #[pyo3(signature = (ptr, size, device=0))]
    fn register_cuda_memory(&self, py: Python<'_>, ptr: u64, size: u64, device: i32) -> PyResult<u32> {
        let _ = device; // the IPC handle identifies the device by UUID
                        // SAFETY: the Python caller vouches that the device range stays allocated until
                        // this Worker is closed (as for register_host_memory).
        self.with(py, |w| unsafe { w.register_memory(umbp_worker::MemorySpec::Cuda { ptr, len: size }) })
    }

    /// Segments are (alloc_id, offset, block_stride, page_bytes, num_blocks); returns the
    /// bytes of one object of this group.
    fn register_layout(&self, py: Python<'_>, group: u16, segments: Vec<(u32, u64, u64, u64, u64)>) -> PyResult<u64> {
        let segs = segments.into_iter().map(|(a, o, s, p, n)| Segment::new(a, o, s, p, n)).collect();
        self.with(py, |w| w.register_layout(group, segs))
    }

    /// Submits a store. With `stream` (a raw CUstream, e.g.
    /// `torch.cuda.current_stream().cuda_stream`) the pool copies only after everything
    /// enqueued on that stream so far has run: no CPU wait after the forward pass.
    #[pyo3(signature = (group, keys, block_ids, stream=None))]
    fn store(&self, py: Python<'_>, group: u16, keys: Vec<Vec<u8>>, block_ids: Vec<u64>, stream: Option<u64>) -> PyResult<u64> {
        let blocks = pair(keys, block_ids)?;
        self.with(py, |w| match stream {
            Some(s) => w.store_after_stream(group, &blocks, s),
            None => w.store(group, &blocks),
        })
        .map(|t| t.0)
    }

    /// Submits a load. With `stream`, kernels enqueued on that stream after this call wait
    /// (on the GPU) until the blocks are in place; check the completion's statuses before
    /// trusting the bytes (failed blocks release the stream too).
    #[pyo3(signature = (group, keys, block_ids, stream=None))]
    fn load(&self, py: Python<'_>, group: u16, keys: Vec<Vec<u8>>, block_ids: Vec<u64>, stream: Option<u64>) -> PyResult<u64> {
        let blocks = pair(keys, block_ids)?;
        self.with(py, |w| match stream {
            Some(s) => w.load_before_stream(group, &blocks, s),
            None => w.load(group, &blocks),
        })
        .map(|t| t.0)
    }

    /// Keeps the attachment while the caller is idle: reaps completions (kept for `poll`),
    /// notices a lost pool and re-attaches to a restarted one (with the backoff). For a
    /// background timer; blocks only while a re-attach re-registers memory.
    fn maintain(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |w| {
            w.maintain();
            Ok(())
        })
    }

    /// Finished transfers: [(transfer id, [status per block])]. Never blocks.
    fn poll(&self, py: Python<'_>) -> PyResult<Vec<(u64, Vec<u32>)>> {
        self.with(py, |w| Ok(w.poll().into_iter().map(|c| (c.id.0, statuses(&c.statuses))).collect()))
    }

    /// Waits up to `timeout_ms` for one transfer; None if it is still pending.
    fn wait(&self, py: Python<'_>, transfer_id: u64, timeout_ms: u64) -> PyResult<Option<Vec<u32>>> {
        self.with(py, |w| {
            Ok(w.wait(umbp_worker::TransferId(transfer_id), Duration::from_millis(timeout_ms)).map(|c| statuses(&c.statuses)))
        })
    }

    /// Gives up on a transfer (the cancel contract, docs/protocol.md): "cancelled" when
    /// its blocks are the caller's again at once (any store; a load the pool had not
    /// started) — its completion, every block failed, is then ready for `wait`/`poll`;
    /// "started" for a load the pool already writes, whose blocks stay in use until it
    /// completes; "not_in_flight" when it already completed or is unknown. Never blocks.
    fn cancel(&self, py: Python<'_>, transfer_id: u64) -> PyResult<&'static str> {
        self.with(py, |w| {
            Ok(match w.cancel(umbp_worker::TransferId(transfer_id)) {
                umbp_worker::CancelOutcome::Cancelled => "cancelled",
                umbp_worker::CancelOutcome::Started => "started",
                umbp_worker::CancelOutcome::NotInFlight => "not_in_flight",
            })
        })
    }

    /// Whether a transfer has waited past timeout_ms for the pool (which then refuses
    /// new ones until it answers or dies).
    #[getter]
    fn stalled(&self) -> bool {
        self.inner.lock().expect("worker lock").as_ref().is_some_and(|w| w.is_stalled())
    }

    #[getter]
    fn connected(&self) -> bool {
        self.inner.lock().expect("worker lock").as_ref().is_some_and(|w| w.is_connected())
    }

    #[getter]
    fn pending(&self) -> usize {
        self.inner.lock().expect("worker lock").as_ref().map_or(0, |w| w.pending())
    }

    /// Drops every object of this worker's namespace from the pool.
    fn reset_namespace(&self, py: Python<'_>) -> PyResult<u64> {
        self.with(py, |w| w.reset_namespace())
    }

    /// Closes the worker. Loads the pool started into registered memory are waited for
    /// (their completion or the pool's death) at most `timeout_ms`, by default the worker's
    /// timeout: a caller with a shutdown budget of its own passes what is left of it.
    #[pyo3(signature = (timeout_ms=None))]
    fn close(&self, py: Python<'_>, timeout_ms: Option<u64>) {
        let w = self.inner.lock().expect("worker lock").take();
        if let Some(w) = w {
            // Without the GIL: the wait may take up to the timeout.
            py.detach(|| match timeout_ms {
                Some(ms) => w.close_within(std::time::Duration::from_millis(ms)),
                None => drop(w),
            });
        }
    }
}

fn pair(keys: Vec<Vec<u8>>, block_ids: Vec<u64>) -> PyResult<Vec<(ObjectKey, u64)>> {
    if keys.len() != block_ids.len() {
        return Err(PyValueError::new_err(format!("{} keys but {} block ids", keys.len(), block_ids.len())));
    }
    Ok(keys_of(keys)?.into_iter().zip(block_ids).collect())
}

/// The scheduler's read-only view of a pool's index: lookups are shared-memory reads.
#[pyclass(module = "umbp._native")]
struct Index {
    inner: Mutex<umbp_scheduler::IndexClient>,
}

#[pymethods]
impl Index {
    /// With `timeout_ms` > 0 the pool must answer in time (error names the socket);
    /// with 0 the index attaches lazily whenever the pool is reachable. Lookups miss while
    /// the pool's heartbeat is older than `stall_timeout_ms` (a stopped pool; at least
    /// 200 ms).
    #[new]
    #[pyo3(signature = (endpoint, namespace=None, timeout_ms=5000, pool_uid=None, stall_timeout_ms=1000))]
    fn new(
        py: Python<'_>,
        endpoint: String,
        namespace: Option<&[u8]>,
        timeout_ms: u64,
        pool_uid: Option<u32>,
        stall_timeout_ms: u64,
    ) -> PyResult<Self> {
        let ns = match namespace {
            Some(n) => u128::from_le_bytes(key16(n, "namespace")?),
            None => 0,
        };
        let path = PathBuf::from(parse_endpoint("endpoint", &endpoint)?);
        let mut client = if timeout_ms == 0 {
            umbp_scheduler::IndexClient::lazy_with_pool_uid(&path, ns, pool_uid)
        } else {
            py.detach(|| umbp_scheduler::IndexClient::connect_with_pool_uid(&path, ns, Duration::from_millis(timeout_ms), pool_uid))
                .map_err(err)?
        };
        client.set_stall_timeout(Duration::from_millis(stall_timeout_ms));
        Ok(Self { inner: Mutex::new(client) })
    }

    /// Number of leading keys present in the pool (stops at the first miss).
    fn match_prefix(&self, keys: Vec<Vec<u8>>) -> PyResult<usize> {
        let keys = keys_of(keys)?;
        Ok(self.inner.lock().expect("index lock").match_prefix(&keys))
    }

    /// `match_prefix` of the keys of `block_hashes` under (namespace, group, rank), derived
    /// here: the scheduler's lookup in one call, without building a key object per block.
    fn match_hashes(&self, namespace: &[u8], group: u32, rank: u32, block_hashes: Vec<PyBackedBytes>) -> PyResult<usize> {
        let ns = u128::from_le_bytes(key16(namespace, "namespace")?);
        let keys: Vec<ObjectKey> = block_hashes.iter().map(|h| ObjectKey::derive(ns, group, rank, h.as_ref())).collect();
        Ok(self.inner.lock().expect("index lock").match_prefix(&keys))
    }

    fn contains(&self, key: &[u8]) -> PyResult<bool> {
        let k = ObjectKey::from_bytes(key16(key, "key")?);
        Ok(self.inner.lock().expect("index lock").contains(k))
    }

    /// Tier of `key`'s object: "dram", "ssd" or "remote"; None when the pool does not hold
    /// it (or is not attached, or is stalled).
    fn tier(&self, key: &[u8]) -> PyResult<Option<&'static str>> {
        let k = ObjectKey::from_bytes(key16(key, "key")?);
        Ok(self.inner.lock().expect("index lock").tier(k).map(|t| t.as_str()))
    }

    #[getter]
    fn connected(&self) -> bool {
        self.inner.lock().expect("index lock").is_attached()
    }

    /// Whether the attached pool is stalled (heartbeat older than `stall_timeout_ms`):
    /// lookups miss meanwhile.
    #[getter]
    fn stalled(&self) -> bool {
        self.inner.lock().expect("index lock").is_stalled()
    }

    /// KV events since the last call, oldest first: `("stored" | "removed", key bytes)`
    /// for objects the pool made visible or dropped (evictions included). Never blocks.
    fn take_events<'py>(&self, py: Python<'py>) -> Vec<(&'static str, Bound<'py, PyBytes>)> {
        let events = self.inner.lock().expect("index lock").take_events();
        events.into_iter().map(|(kind, key)| (kind.as_str(), PyBytes::new(py, &key.to_bytes()))).collect()
    }

    /// `take_events` with each event's tier: `("stored" | "removed", key bytes, "dram" |
    /// "ssd" | "remote")`. A demotion to SSD is ("removed", k, "dram") then ("stored", k,
    /// "ssd"); a promotion the reverse.
    fn take_tier_events<'py>(&self, py: Python<'py>) -> Vec<(&'static str, Bound<'py, PyBytes>, &'static str)> {
        let events = self.inner.lock().expect("index lock").take_tier_events();
        events.into_iter().map(|e| (e.kind.as_str(), PyBytes::new(py, &e.key.to_bytes()), e.tier.as_str())).collect()
    }

    /// KV events missed because `take_events` was called too rarely (log overrun).
    #[getter]
    fn events_lost(&self) -> u64 {
        self.inner.lock().expect("index lock").events_lost()
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("PROTOCOL_VERSION", umbp_protocol::PROTOCOL_VERSION)?;
    m.add("UmbpError", m.py().get_type::<UmbpError>())?;
    for (name, s) in [
        ("STATUS_PENDING", BlockStatus::Pending),
        ("STATUS_STORED", BlockStatus::Stored),
        ("STATUS_ALREADY_PRESENT", BlockStatus::AlreadyPresent),
        ("STATUS_NOT_STORED", BlockStatus::NotStored),
        ("STATUS_LOADED", BlockStatus::Loaded),
        ("STATUS_MISSING", BlockStatus::Missing),
        ("STATUS_FAILED", BlockStatus::Failed),
        ("STATUS_INVALID", BlockStatus::Invalid),
    ] {
        m.add(name, s as u8)?;
    }
    m.add_function(wrap_pyfunction!(object_key, m)?)?;
    m.add_function(wrap_pyfunction!(object_keys, m)?)?;
    m.add_function(wrap_pyfunction!(namespace_digest, m)?)?;
    m.add_function(wrap_pyfunction!(default_socket_path, m)?)?;
    m.add_function(wrap_pyfunction!(parse_endpoint, m)?)?;
    m.add_function(wrap_pyfunction!(parse_size, m)?)?;
    m.add_function(wrap_pyfunction!(pool_settings, m)?)?;
    m.add_function(wrap_pyfunction!(init_logging, m)?)?;
    m.add_class::<EmbeddedPool>()?;
    m.add_class::<Worker>()?;
    m.add_class::<Index>()?;
    Ok(())
}
