use std::io;
use std::path::PathBuf;

use umbp_ipc::message::MessageError;
use umbp_protocol::ProtocolError;

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// No pool answered at the endpoint within the startup timeout.
    #[error("UMBP pool not reachable at {}: {source} (is umbp-pool running there? see --socket / UMBP_STANDALONE_ADDRESS)", path.display())]
    Unreachable { path: PathBuf, source: io::Error },
    /// The pool answered with a refusal (version, permissions, bad registration).
    #[error("refused by the UMBP pool: {message}")]
    Refused { message: String },
    /// No attachment right now; one is being re-established in the background.
    #[error("not attached to the UMBP pool (reconnecting in the background)")]
    Disconnected,
    /// A transfer has gone without a completion past the timeout; no new work is sent to a
    /// pool that may be stuck, until it answers or dies.
    #[error("UMBP pool stalled: a transfer has waited {oldest_ms} ms for completion; new transfers are refused meanwhile")]
    Stalled { oldest_ms: u64 },
    /// Submission ring, completion capacity or arena exhausted: nothing was submitted;
    /// reap completions and retry.
    #[error("UMBP submission queue or arena full; retry after reaping completions")]
    Full,
    #[error("invalid request: {0}")]
    Invalid(String),
    /// A GPU or host-memory call in this process failed (exporting memory to register,
    /// allowing the pool to read it, a stream fence); `what` names the call and its
    /// consequence.
    #[error("{what}: {source}")]
    Gpu { what: String, source: umbp_gpu::GpuError },
    /// Shared memory of this process could not be created (`what` names the region).
    #[error("{what}: {source}")]
    Shm { what: &'static str, source: umbp_ipc::ShmError },
    #[error("I/O error talking to the UMBP pool: {0}")]
    Io(#[from] io::Error),
    #[error("UMBP protocol error: {0}")]
    Protocol(#[from] ProtocolError),
}

impl From<MessageError> for WorkerError {
    fn from(e: MessageError) -> Self {
        match e {
            MessageError::Closed => WorkerError::Disconnected,
            MessageError::Timeout => WorkerError::Io(io::Error::new(io::ErrorKind::TimedOut, "UMBP pool did not answer in time")),
            MessageError::Io(e) => WorkerError::Io(e),
            MessageError::Protocol(p) => WorkerError::Protocol(p),
            e @ (MessageError::FdCount { .. } | MessageError::FdsTruncated) => {
                WorkerError::Io(io::Error::new(io::ErrorKind::InvalidData, e))
            }
        }
    }
}

impl From<umbp_ipc::ShmError> for WorkerError {
    /// A region the pool sent that cannot be mapped: the attachment is unusable, as for
    /// a broken socket (the `ShmError` is the io error's source).
    fn from(e: umbp_ipc::ShmError) -> Self {
        WorkerError::Io(io::Error::other(e))
    }
}
