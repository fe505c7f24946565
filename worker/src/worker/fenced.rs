//! The stream-ordered calls of a worker (docs/gpu.md "Stream-ordered transfers"; the
//! mechanism, a fence page of words the engine's stream and the pool order on, is
//! crate::fence).

use super::*;
use crate::fence::Fences;

impl Worker {
    /// Stream-ordered store (docs/gpu.md "Stream-ordered transfers"): the pool copies `blocks` only after `stream` (a
    /// raw `CUstream` as an integer, 0 = legacy default stream; e.g. torch's current
    /// stream) has run everything enqueued on it before this call. Returns at once; the
    /// CPU never waits for the GPU. Completion as for [`Worker::store`].
    ///
    /// Needs CUDA in this process; the first call sets up the fence page (one control
    /// round trip). If the stream write cannot be enqueued, the store is aborted (it
    /// completes as failed) and this returns the error.
    pub fn store_after_stream(&mut self, group: u16, blocks: &[(ObjectKey, u64)], stream: u64) -> Result<TransferId, WorkerError> {
        let (id, slot) = self.submit_with_fence(Opcode::Store, group, blocks, stream)?;
        let Some(slot) = slot else { return Ok(id) };
        self.fences.as_mut().expect("set up by fence_slot").order_store(slot, id.0, stream)?;
        Ok(id)
    }

    /// Stream-ordered load (docs/gpu.md "Stream-ordered transfers"): submits the load and makes `stream` wait (on the
    /// GPU) until the pool has written the blocks; kernels enqueued on `stream` after this
    /// call read the loaded KV. The CPU does not wait. Whether each block loaded is in the
    /// completion, as for [`Worker::load`]: the stream is released also when the load
    /// failed, so check it before trusting the bytes (vLLM: report load errors).
    ///
    /// If the wait cannot be enqueued, the load still runs; this returns an error naming
    /// its transfer id, and the caller must wait for its completion on the CPU.
    pub fn load_before_stream(&mut self, group: u16, blocks: &[(ObjectKey, u64)], stream: u64) -> Result<TransferId, WorkerError> {
        let (id, slot) = self.submit_with_fence(Opcode::Load, group, blocks, stream)?;
        let Some(slot) = slot else { return Ok(id) };
        let sock = self.attachment_socket().and_then(|(att, s, p)| s.try_clone().ok().map(|s| (att, s, p)));
        self.fences.as_mut().expect("set up by fence_slot").order_load(slot, id.0, stream, sock)?;
        Ok(id)
    }

    /// Submits `op` carrying a fence slot, which it claims for the new transfer; the caller
    /// then ties the slot's word to `stream`. An empty transfer moves no bytes, so there is
    /// nothing to order against the stream: it is submitted unfenced (slot None).
    fn submit_with_fence(
        &mut self,
        op: Opcode,
        group: u16,
        blocks: &[(ObjectKey, u64)],
        stream: u64,
    ) -> Result<(TransferId, Option<u32>), WorkerError> {
        if blocks.is_empty() {
            return Ok((self.submit_fenced(op, group, blocks, None)?, None));
        }
        let (alloc, slot) = self.fence_slot(stream)?;
        let id = self.submit_fenced(op, group, blocks, Some((alloc, slot)))?;
        self.fences.as_mut().expect("set up by fence_slot").claim(slot, id.0);
        Ok((id, Some(slot)))
    }

    /// Whether stream-ordered transfers are set up (after the first one succeeded).
    pub fn fences_ready(&self) -> bool {
        self.fences.is_some()
    }

    /// The slot for the next fenced transfer, setting the page up on first use.
    fn fence_slot(&mut self, stream: u64) -> Result<(u32, u32), WorkerError> {
        let mut f = match self.fences.take() {
            Some(f) => f,
            None => Fences::create(stream, |fd, len| self.register_memfd(fd, 0, len))?,
        };
        // Out of `self` while it asks which transfers are in flight.
        let r = f.next_slot(|id| self.in_flight(id));
        self.fences = Some(f);
        r
    }
}
