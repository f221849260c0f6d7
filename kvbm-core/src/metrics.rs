//! Counters behind the Prometheus metrics of DESIGN.md (the exporter comes with the bindings).
//!
//! Names follow Dynamo KVBM's where they exist (`kvbm_offload_blocks_d2h`, ...). Counters are
//! relaxed atomics bumped by the leader, the worker and the copy engine; a snapshot reads them all.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency histogram buckets, in microseconds (the last bucket is +Inf).
pub const LATENCY_BUCKETS_US: [u64; 16] = [
    10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000,
    1_000_000, 5_000_000,
];

/// A fixed-bucket latency histogram.
#[derive(Debug, Default)]
pub struct LatencyHistogram {
    buckets: [AtomicU64; LATENCY_BUCKETS_US.len() + 1],
    count: AtomicU64,
    sum_us: AtomicU64,
}

impl LatencyHistogram {
    /// Records one observation.
    pub fn observe(&self, latency: Duration) {
        let us = latency.as_micros().min(u128::from(u64::MAX)) as u64;
        let bucket = LATENCY_BUCKETS_US.partition_point(|&bound| bound < us);
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
    }

    /// (count per bucket, total count, sum in microseconds).
    pub fn snapshot(&self) -> (Vec<u64>, u64, u64) {
        (
            self.buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect(),
            self.count.load(Ordering::Relaxed),
            self.sum_us.load(Ordering::Relaxed),
        )
    }
}

/// The block manager's counters.
#[derive(Debug, Default)]
pub struct Metrics {
    /// `kvbm_offload_blocks_d2h`: blocks offloaded GPU to host.
    pub offload_blocks_d2h: AtomicU64,
    /// `kvbm_offload_blocks_h2d`: blocks offloaded host to disk.
    pub offload_blocks_h2d: AtomicU64,
    /// `kvbm_onboard_blocks_h2d`: blocks onboarded host to GPU.
    pub onboard_blocks_h2d: AtomicU64,
    /// `kvbm_onboard_blocks_d2d`: blocks onboarded disk to GPU.
    pub onboard_blocks_d2d: AtomicU64,
    /// `kvbm_matched_tokens`: tokens matched in host and disk for loading.
    pub matched_tokens: AtomicU64,
    /// Blocks looked up in the host tier.
    pub host_lookup_blocks: AtomicU64,
    /// Blocks found in the host tier.
    pub host_hit_blocks: AtomicU64,
    /// Blocks looked up in the disk tier.
    pub disk_lookup_blocks: AtomicU64,
    /// Blocks found in the disk tier.
    pub disk_hit_blocks: AtomicU64,
    /// `kvbm_bytes_d2h`: bytes copied GPU to host.
    pub bytes_d2h: AtomicU64,
    /// `kvbm_bytes_h2d`: bytes copied host to GPU.
    pub bytes_h2d: AtomicU64,
    /// `kvbm_offload_skipped_blocks`: offloads not done (target tier full of held blocks, or
    /// the transfer queue at its limit).
    pub offload_skipped_blocks: AtomicU64,
    /// `kvbm_offload_deduplicated_blocks`: offloads that were no-ops (already resident or queued).
    pub offload_deduplicated_blocks: AtomicU64,
    /// `kvbm_transfer_errors`: transfer batches that failed.
    pub transfer_errors: AtomicU64,
    /// `kvbm_disk_write_failures`: host blocks whose disk write failed or was refused.
    pub disk_write_failures: AtomicU64,
    /// `kvbm_disk_read_blocks`: disk blocks a worker read into host blocks.
    pub disk_read_blocks: AtomicU64,
    /// `kvbm_disk_read_misses`: of those, blocks that failed verification or could not be read.
    pub disk_read_misses: AtomicU64,
    /// `kvbm_load_errors`: GPU blocks reported to the engine as failed onboards (recomputed).
    pub load_errors: AtomicU64,
    /// Blocks looked up in the shared tier (past the local hit).
    pub shared_lookup_blocks: AtomicU64,
    /// Blocks found in the shared tier.
    pub shared_hit_blocks: AtomicU64,
    /// `kvbm_shared_read_blocks`: shared-tier blocks a worker read into host blocks.
    pub shared_read_blocks: AtomicU64,
    /// `kvbm_shared_read_misses`: of those, blocks that were missing, refused or late.
    pub shared_read_misses: AtomicU64,
    /// `kvbm_shared_write_blocks`: host blocks a worker queued for the shared tier.
    pub shared_write_blocks: AtomicU64,
    /// `kvbm_transfer_latency_d2h`: per batch, submit to completion.
    pub latency_d2h: LatencyHistogram,
    /// `kvbm_transfer_latency_h2d`: per batch, submit to completion.
    pub latency_h2d: LatencyHistogram,
}

/// Plain values of [`Metrics`] at one moment, plus derived rates.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct MetricsSnapshot {
    /// See [`Metrics::offload_blocks_d2h`].
    pub offload_blocks_d2h: u64,
    /// See [`Metrics::offload_blocks_h2d`].
    pub offload_blocks_h2d: u64,
    /// See [`Metrics::onboard_blocks_h2d`].
    pub onboard_blocks_h2d: u64,
    /// See [`Metrics::onboard_blocks_d2d`].
    pub onboard_blocks_d2d: u64,
    /// See [`Metrics::matched_tokens`].
    pub matched_tokens: u64,
    /// `kvbm_host_cache_hit_rate`: host hits over host lookups (0 before any lookup).
    pub host_cache_hit_rate: f64,
    /// `kvbm_disk_cache_hit_rate`: disk hits over disk lookups (0 before any lookup).
    pub disk_cache_hit_rate: f64,
    /// See [`Metrics::bytes_d2h`].
    pub bytes_d2h: u64,
    /// See [`Metrics::bytes_h2d`].
    pub bytes_h2d: u64,
    /// See [`Metrics::offload_skipped_blocks`].
    pub offload_skipped_blocks: u64,
    /// See [`Metrics::offload_deduplicated_blocks`].
    pub offload_deduplicated_blocks: u64,
    /// See [`Metrics::transfer_errors`].
    pub transfer_errors: u64,
    /// See [`Metrics::disk_write_failures`].
    pub disk_write_failures: u64,
    /// See [`Metrics::disk_read_blocks`].
    pub disk_read_blocks: u64,
    /// See [`Metrics::disk_read_misses`].
    pub disk_read_misses: u64,
    /// See [`Metrics::load_errors`].
    pub load_errors: u64,
    /// `kvbm_shared_cache_hit_rate`: shared hits over shared lookups (0 before any lookup).
    pub shared_cache_hit_rate: f64,
    /// See [`Metrics::shared_read_blocks`].
    pub shared_read_blocks: u64,
    /// See [`Metrics::shared_read_misses`].
    pub shared_read_misses: u64,
    /// See [`Metrics::shared_write_blocks`].
    pub shared_write_blocks: u64,
    /// `kvbm_host_pinned_bytes_ready`: host tier bytes pinned so far.
    pub host_pinned_bytes_ready: u64,
}

impl Metrics {
    /// Reads every counter; `host_pinned_bytes_ready` is filled in by the manager.
    pub fn snapshot(&self) -> MetricsSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let rate = |hits: u64, lookups: u64| {
            if lookups == 0 {
                0.0
            } else {
                hits as f64 / lookups as f64
            }
        };
        MetricsSnapshot {
            offload_blocks_d2h: get(&self.offload_blocks_d2h),
            offload_blocks_h2d: get(&self.offload_blocks_h2d),
            onboard_blocks_h2d: get(&self.onboard_blocks_h2d),
            onboard_blocks_d2d: get(&self.onboard_blocks_d2d),
            matched_tokens: get(&self.matched_tokens),
            host_cache_hit_rate: rate(get(&self.host_hit_blocks), get(&self.host_lookup_blocks)),
            disk_cache_hit_rate: rate(get(&self.disk_hit_blocks), get(&self.disk_lookup_blocks)),
            bytes_d2h: get(&self.bytes_d2h),
            bytes_h2d: get(&self.bytes_h2d),
            offload_skipped_blocks: get(&self.offload_skipped_blocks),
            offload_deduplicated_blocks: get(&self.offload_deduplicated_blocks),
            transfer_errors: get(&self.transfer_errors),
            disk_write_failures: get(&self.disk_write_failures),
            disk_read_blocks: get(&self.disk_read_blocks),
            disk_read_misses: get(&self.disk_read_misses),
            load_errors: get(&self.load_errors),
            shared_cache_hit_rate: rate(
                get(&self.shared_hit_blocks),
                get(&self.shared_lookup_blocks),
            ),
            shared_read_blocks: get(&self.shared_read_blocks),
            shared_read_misses: get(&self.shared_read_misses),
            shared_write_blocks: get(&self.shared_write_blocks),
            host_pinned_bytes_ready: 0,
        }
    }
}

pub(crate) fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}
