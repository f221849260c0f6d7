//! kvbm-events: the vocabulary that kvbm's engine side and router side share.
//!
//! Owns: block and sequence hashes (bit-for-bit Dynamo's KV-router hash), the storage [`Tier`]s and
//! their wire medium names, the KV cache event model, and a bounded in-process event bus.
//! Also owns the wire codec ([`wire`]: vLLM's, SGLang's and Dynamo's msgpack event batches).
//! Does not own: anything about memory, copies or pools (kvbm-cuda, kvbm-core), nor the ZMQ
//! transports and the router (a later addition to this crate).
//!
//! Invariants:
//! - A hash is computed only over a full block; a partial trailing block has no hash.
//! - Publishing an event never blocks: a subscriber that falls behind loses events, the loss is
//!   counted, and the subscriber sees it as a gap in the per-publisher sequence numbers.

mod bus;
mod event;
mod hash;
pub mod router;
mod tier;
pub mod transport;
pub mod wire;

pub use bus::{Delivery, EventPublisher, EventSubscriber, SUBSCRIBER_CAPACITY_MAX};
pub use event::{BlockRemoved, BlockStored, EventRecord, GroupKind, GroupRole, KvEvent};
pub use hash::{
    namespace_term, BlockHash, BlockHasher, PassThroughBuildHasher, PassThroughHasher,
    SequenceHash, BLOCK_HASH_SEED, LORA_NAME_SEED, NAMESPACE_SEED,
};
pub use tier::{Tier, TierParseError};
pub use transport::{
    request_replay, LinkState, LinkStatus, PublisherConfig, PublisherStats, SubscriberEvent,
    SubscriberOptions, SubscriberStats, TransportError, WorkerEndpoint, ZmqPublisher,
    ZmqSubscriber,
};
pub use wire::{decode_batch, encode_batch, DecodeError, Location, WireBatch, WireEvent};
