//! What the selector tests share: candidates and loads written as data.

use kvbm_events::router::{Candidate, Overlap, WorkerLoad};

/// Worker `id` with `gpu`, `host` and `disk` blocks of overlap and `load`.
pub fn cand(id: u64, gpu: usize, host: usize, disk: usize, load: WorkerLoad) -> Candidate {
    Candidate {
        worker: (id, 0),
        overlap: Overlap {
            gpu,
            host,
            disk,
            shared: 0,
        },
        load,
        excess_work: 0.0,
    }
}

/// A worker's load.
pub fn load(prefill_tokens: usize, decode_blocks: usize, requests: usize) -> WorkerLoad {
    WorkerLoad {
        prefill_tokens,
        decode_blocks,
        requests,
    }
}
