//! What the block manager hands its callers for a copy: the transfer limits every copy runs
//! under, and the ticket of one offload or onboard with its outcome.
//!
//! Invariants:
//! - A ticket counts a batch done only after the batch's blocks were dealt with (the copy
//!   engine runs a batch's callback before its job counts it done): an onboard's targets
//!   registered, or returned to `Free` if the copy failed; an offload's GPU sources
//!   released): whoever waits on it sees the pools as the batch left them.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::copy::CopyTicket;
use crate::pool::RegisteredBlock;
use crate::CoreError;

/// Limits of the engine (DESIGN.md's `DYN_KVBM_MAX_TRANSFER_BATCH_SIZE` and
/// `DYN_KVBM_MAX_CONCURRENT_TRANSFERS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferLimits {
    /// Blocks per batch. Default 16.
    pub batch_blocks_max: usize,
    /// Batches on the copy streams at once. Default 4.
    pub inflight_max: usize,
    /// Batches waiting for a stream slot; a submission beyond waits for room. Default 1024.
    pub pending_max: usize,
    /// How the copy streams copy (`KVBM_COPY_COALESCE`, `KVBM_COPY_BATCH`).
    pub copy: kvbm_cuda::StreamOptions,
}

impl Default for TransferLimits {
    fn default() -> Self {
        Self {
            batch_blocks_max: 16,
            inflight_max: 4,
            pending_max: 1024,
            copy: kvbm_cuda::StreamOptions::default(),
        }
    }
}

/// Per-batch timing, for latency figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLatency {
    /// Blocks in the batch.
    pub blocks: usize,
    /// From submission to the stream until the completion was seen.
    pub latency: Duration,
}

/// What a finished request did.
#[derive(Debug, Default)]
pub struct TransferOutcome {
    /// Onboard: the registered target blocks, in request order (held). Offload: empty (the host
    /// copies are registered and idle, findable by hash).
    pub blocks: Vec<RegisteredBlock>,
    /// Blocks copied and registered.
    pub copied: usize,
    /// Blocks not copied because the target tier already held them (or the request named them
    /// twice).
    pub deduplicated: usize,
    /// Blocks not copied for lack of space in the target tier.
    pub skipped: usize,
    /// Timing of each batch.
    pub batches: Vec<BatchLatency>,
    /// The first failure, if any block failed (an onboard's failed targets were not
    /// registered; an offload's failed host blocks leave the host tier and are never served).
    pub error: Option<CoreError>,
}

#[derive(Debug, Default)]
struct TicketState {
    outcome: TransferOutcome,
    /// Onboard: the registered targets, by position in the request.
    slots: Vec<Option<RegisteredBlock>>,
}

/// What a request's batches report into, from the copy engine's callbacks.
#[derive(Debug, Default)]
pub(crate) struct TicketShared {
    state: Mutex<TicketState>,
}

impl TicketShared {
    /// The record of a request of which `slots` blocks are kept for the caller, and
    /// `deduplicated` and `skipped` were not copied.
    pub(crate) fn new(slots: usize, deduplicated: usize, skipped: usize) -> Arc<Self> {
        let shared = Arc::new(Self::default());
        {
            let mut state = shared.state.lock();
            state.outcome.deduplicated = deduplicated;
            state.outcome.skipped = skipped;
            state.slots = (0..slots).map(|_| None).collect();
        }
        shared
    }

    /// Blocks that failed before any copy: recorded as `error`.
    pub(crate) fn refused(&self, error: CoreError) {
        self.state.lock().outcome.error.get_or_insert(error);
    }

    /// One batch finished: `copied` blocks copied, the targets kept for the caller (by their
    /// position in the request), or the batch's error.
    pub(crate) fn batch_done(
        &self,
        copied: usize,
        kept: Vec<(usize, RegisteredBlock)>,
        latency: BatchLatency,
        error: Option<CoreError>,
    ) {
        let mut state = self.state.lock();
        state.outcome.copied += copied;
        state.outcome.batches.push(latency);
        if let Some(error) = error {
            state.outcome.error.get_or_insert(error);
        }
        for (i, block) in kept {
            state.slots[i] = Some(block);
        }
    }
}

/// A request's handle: wait for it, or drop it (the copies go on, and their blocks are dealt
/// with all the same).
#[derive(Debug)]
pub struct TransferTicket {
    /// The copy job, if anything was copied; its batches' callbacks report into `shared`
    /// before the job counts them done.
    copy: Option<CopyTicket>,
    shared: Arc<TicketShared>,
}

impl TransferTicket {
    pub(crate) fn new(shared: Arc<TicketShared>, copy: Option<CopyTicket>) -> Self {
        Self { copy, shared }
    }

    /// True when every batch finished (or there was nothing to copy).
    pub fn is_done(&self) -> bool {
        self.copy.as_ref().is_none_or(CopyTicket::is_done)
    }

    /// Waits for every batch and returns the outcome.
    pub fn wait(self) -> TransferOutcome {
        if let Some(copy) = &self.copy {
            copy.wait();
        }
        let mut state = self.shared.state.lock();
        let mut outcome = std::mem::take(&mut state.outcome);
        outcome.blocks = state.slots.drain(..).flatten().collect();
        outcome
    }
}
