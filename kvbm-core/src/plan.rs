//! What crosses from the leader to the workers each step, and back: a typed plan that serialises
//! to MessagePack bytes (vLLM pickles the connector metadata between its processes; the plan
//! travels inside it as one `bytes` object), and the worker's typed report.
//!
//! Block ids are the leader's: host and disk ids are valid on every rank; GPU ids are vLLM's.
//!
//! Invariant: a plan decoded from bytes has been checked for shape only (types, lengths); the
//! worker checks every id against its own pools before touching memory.

use serde::{Deserialize, Serialize};

use crate::CoreError;

/// A disk read: a disk block into a staging host block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskRead {
    /// The disk block (slot).
    pub disk: u32,
    /// The host block to read it into.
    pub host: u32,
    /// The block's key (its sequence hash).
    pub key: u64,
}

/// A disk write: a host block into a disk block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskWrite {
    /// The host block.
    pub host: u32,
    /// The disk block (slot).
    pub disk: u32,
    /// The block's key (its sequence hash).
    pub key: u64,
    /// The block's identity for its disk header ([`crate::encode_identity`]).
    #[serde(with = "serde_bytes_vec")]
    pub identity: Vec<u8>,
}

/// A shared-tier read: a block of the shared store into a staging host block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedRead {
    /// The host block to read it into.
    pub host: u32,
    /// The block's key (its sequence hash).
    pub key: u64,
}

/// A shared-tier write: a host block into the shared store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedWrite {
    /// The host block.
    pub host: u32,
    /// The block's key (its sequence hash).
    pub key: u64,
    /// Its tenant ([`crate::shared::tenant_id`]).
    pub tenant: u64,
    /// The block's identity ([`crate::encode_identity`]).
    #[serde(with = "serde_bytes_vec")]
    pub identity: Vec<u8>,
}

/// A request's onboard: host blocks into the GPU blocks vLLM allocated, `(host, gpu)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Onboard {
    /// vLLM's request id.
    pub request: String,
    /// `(host block, GPU block)` pairs.
    pub pairs: Vec<(u32, u32)>,
}

/// An asynchronous onboard: disk reads into staging host blocks, then host blocks into GPU
/// blocks; the workers report the request in `finished_recving` when done.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AsyncOnboard {
    /// vLLM's request id.
    pub request: String,
    /// Disk reads into staging host blocks, done first.
    pub disk_reads: Vec<DiskRead>,
    /// `(host block, GPU block)` pairs, staging blocks included.
    pub pairs: Vec<(u32, u32)>,
    /// GPU blocks of the request's hit the leader could not back (evicted since matched): they
    /// fail with the job, which reports them with the request (a hybrid model's onboard, where
    /// vLLM takes only a failed request, never block-level load errors).
    #[serde(default)]
    pub unbacked: Vec<u32>,
    /// Shared-tier reads into staging host blocks, done first (with the disk reads).
    #[serde(default)]
    pub shared_reads: Vec<SharedRead>,
    /// The tenant of the shared reads ([`crate::shared::tenant_id`]).
    #[serde(default)]
    pub tenant: u64,
}

/// A request's offload: GPU blocks that became complete into host blocks, `(gpu, host)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Offload {
    /// vLLM's request id.
    pub request: String,
    /// `(GPU block, host block)` pairs.
    pub pairs: Vec<(u32, u32)>,
}

/// One scheduler step's instructions for every worker.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepPlan {
    /// The leader's step number.
    pub step: u64,
    /// Requests vLLM preempted in this step: their GPU blocks are reused as soon as the worker's
    /// `handle_preemptions` returns, so their offloads must be done by then.
    pub preempted: Vec<String>,
    /// Disk reads into the staging host blocks of this step's synchronous onboards.
    pub disk_reads: Vec<DiskRead>,
    /// Synchronous onboards, done before the layers that need them run.
    pub onboards: Vec<Onboard>,
    /// Asynchronous onboards (disk reads and copies in the background).
    pub async_onboards: Vec<AsyncOnboard>,
    /// Offloads of the blocks that become complete in this step (after the forward pass).
    pub offloads: Vec<Offload>,
    /// Disk writes of host blocks admitted to disk (after this step's offloads into them).
    pub disk_writes: Vec<DiskWrite>,
    /// GPU blocks promised to vLLM that the leader could not back (evicted since they were
    /// matched): reported as load errors so that vLLM recomputes them.
    pub load_errors: Vec<u32>,
    /// Some offloads read GPU blocks vLLM may free and reuse from the next step on without
    /// telling the connector (a hybrid model's sliding-window and Mamba groups:
    /// `remove_skipped_blocks` in every `allocate_slots`): the engine's later GPU work must be
    /// ordered after this step's offloads.
    #[serde(default)]
    pub fence_offloads: bool,
    /// Shared-tier writes of host blocks (after this step's offloads into them).
    #[serde(default)]
    pub shared_writes: Vec<SharedWrite>,
}

impl StepPlan {
    /// True when the plan asks nothing of the workers.
    pub fn is_empty(&self) -> bool {
        self.preempted.is_empty()
            && self.disk_reads.is_empty()
            && self.onboards.is_empty()
            && self.async_onboards.is_empty()
            && self.offloads.is_empty()
            && self.disk_writes.is_empty()
            && self.load_errors.is_empty()
            && self.shared_writes.is_empty()
    }

    /// The plan as MessagePack bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        rmp_serde::to_vec(self).expect("a plan always serialises")
    }

    /// A plan from [`Self::to_bytes`]'s bytes; malformed bytes are an `InvalidArgument`.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, CoreError> {
        rmp_serde::from_slice(bytes)
            .map_err(|e| CoreError::InvalidArgument(format!("malformed step plan: {e}")))
    }
}

/// What a worker reports back to vLLM after a step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepReport {
    /// Finished requests whose offloads all completed (vLLM may free their GPU blocks now).
    pub finished_offloading: Vec<String>,
    /// Requests whose asynchronous onboards completed (their failed blocks are in
    /// `failed_blocks`).
    pub finished_onboarding: Vec<String>,
    /// GPU blocks whose onboard failed, sorted, without repeats (vLLM recomputes them).
    pub failed_blocks: Vec<u32>,
    /// Host blocks whose content went bad since the last report (a failed offload or disk
    /// read), for the leader to drop ([`crate::Leader::discard`]).
    pub bad_host_blocks: Vec<u32>,
    /// Disk blocks whose write failed since the last report, for the leader to drop.
    pub bad_disk_blocks: Vec<u32>,
}

/// Identity bytes as a MessagePack `bin`, not an array of integers.
mod serde_bytes_vec {
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(v)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = Vec<u8>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("bytes")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
                Ok(v.to_vec())
            }
            fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
                Ok(v)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<Vec<u8>, A::Error> {
                let mut out = Vec::with_capacity(a.size_hint().unwrap_or(0).min(1 << 16));
                while let Some(b) = a.next_element::<u8>()? {
                    out.push(b);
                }
                Ok(out)
            }
        }
        d.deserialize_bytes(Visitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> StepPlan {
        StepPlan {
            step: 7,
            preempted: vec!["p".into()],
            disk_reads: vec![DiskRead {
                disk: 3,
                host: 9,
                key: u64::MAX,
            }],
            onboards: vec![Onboard {
                request: "a".into(),
                pairs: vec![(1, 2), (9, 3)],
            }],
            async_onboards: vec![AsyncOnboard {
                request: "b".into(),
                disk_reads: vec![],
                pairs: vec![(4, 5)],
                unbacked: vec![8],
                shared_reads: vec![SharedRead { host: 12, key: 99 }],
                tenant: 5,
            }],
            offloads: vec![Offload {
                request: "c".into(),
                pairs: vec![(6, 7)],
            }],
            disk_writes: vec![DiskWrite {
                host: 7,
                disk: 0,
                key: 42,
                identity: vec![0, 1, 255],
            }],
            load_errors: vec![11],
            fence_offloads: true,
            shared_writes: vec![SharedWrite {
                host: 13,
                key: 77,
                tenant: 0,
                identity: vec![9, 8],
            }],
        }
    }

    #[test]
    fn round_trips_through_bytes() {
        let plan = sample();
        let bytes = plan.to_bytes();
        assert_eq!(StepPlan::from_bytes(&bytes).unwrap(), plan);
        assert!(StepPlan::default().is_empty());
        assert!(!plan.is_empty());
    }

    #[test]
    fn malformed_bytes_are_an_error_never_a_panic() {
        let bytes = sample().to_bytes();
        for cut in 0..bytes.len() {
            assert!(StepPlan::from_bytes(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        for (i, junk) in [
            [0xc1u8].as_slice(),
            &[0x92, 0x01],
            &[0xff; 16],
            b"not a plan",
        ]
        .iter()
        .enumerate()
        {
            assert!(StepPlan::from_bytes(junk).is_err(), "junk {i}");
        }
        // A disk block id beyond 32 bits is refused at decoding, not truncated.
        let mut v = rmpv::Value::from(0);
        if let Ok(rmpv::Value::Array(mut fields)) = rmpv::decode::read_value(&mut bytes.as_slice())
        {
            fields[2] = rmpv::Value::Array(vec![rmpv::Value::Array(vec![
                rmpv::Value::from(1u64 << 33),
                rmpv::Value::from(0),
                rmpv::Value::from(0),
            ])]);
            v = rmpv::Value::Array(fields);
        }
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &v).unwrap();
        assert!(StepPlan::from_bytes(&out).is_err());
    }
}
