//! The KV-aware router: pick the worker that holds most of a request's prefix, weighed against
//! how busy each worker is.
//!
//! Owns: the selector (Dynamo's default cost, reproduced: [`selector`]) and the tracking of routed
//! requests' load ([`load`]). The per-worker, per-tier block index and the `kvbm-router` service
//! come next.

pub mod load;
pub mod selector;

pub use load::{LoadTracker, RequestId, WorkerLoad, REQUEST_TTL_DEFAULT};
pub use selector::{select, Candidate, Overlap, Selection, SelectorConfig, WorkerKey};
