//! The KV-aware router: pick the worker that holds most of a request's prefix, weighed against
//! how busy each worker is.
//!
//! Owns: the per-worker, per-tier block index ([`index`]) with the translation of engine hashes
//! to block identity ([`translate`]), a hybrid worker's KV cache groups (`groups`: sliding-window
//! and Mamba groups cut a match where vLLM would cut the hit), pages smaller than a block
//! regrouped into blocks (`regroup`: SGLang's page size 1), the selector (the routing modes,
//! Dynamo's default cost reproduced: [`selector`]), the self-tuning cost ([`tune`]), the tracking of routed requests' load ([`load`]) and of each worker's recent work
//! ([`work`]), and the blocks a
//! routing decision predicts on its worker ([`predict`]). The
//! service around them is the `kvbm-router` crate.

mod groups;
pub mod index;
pub mod load;
mod mapped;
pub mod predict;
mod regroup;
pub mod selector;
mod table;
pub mod translate;
pub mod tune;
pub mod work;

pub use index::{
    ApplyStatus, GroupEntry, GroupHolding, Holding, KvIndex, NameEntry, PageEntry, WorkerSnapshot,
    BLOCKS_PER_WORKER_MAX_DEFAULT, BLOCK_SIZE_DEFAULT, INDEX_CAPACITY_BLOCKS_MAX,
    MIN_TOMBSTONES_DEFAULT, POOLS_MAX, POOL_RANK,
};
pub use load::{LoadTracker, RequestId, WorkerLoad, REQUEST_TTL_DEFAULT};
pub use predict::{with_prediction, Predictions, PREDICTIONS_MAX_DEFAULT};
pub use selector::{
    pick, select, select_mode, Candidate, Overlap, RoundRobin, RouterMode, Selection,
    SelectorConfig, Weights, WorkerKey, DYNAMO_WEIGHTS, KV_WEIGHTS, ROUTER_MODE_DEFAULT,
    SHARED_WEIGHT_DEFAULT,
};
pub use translate::Refusal;
pub use tune::{Coefficients, DynamoEquivalent, RouteFeatures, Tuner, TunerCounts, WorkerView};
pub use work::{RecentWork, BALANCE_HALF_LIFE_DEFAULT};
