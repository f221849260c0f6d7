//! The worker: the physical half of the split engine (vLLM's GPU worker side). It owns one
//! rank's bytes: the engine's GPU memory (registered views), its shard of the pinned host pool,
//! its disk cache file, and the copy streams. It executes the leader's [`StepPlan`] through the
//! [`CopyEngine`] (batches, bounded in-flight limits) and the zero-copy host<->disk hand-off
//! (io_uring on the pinned host pool), and reports what finished and what failed.
//!
//! Ordering rules (what makes a plan's block ids safe to act on; ARCHITECTURE.md has the why):
//! - A host block is read (by an onboard or a disk write) or overwritten (by a disk read) only
//!   after every offload into it completed: onboards and disk reads wait for them
//!   ([`Worker::wait_offloads_touching`]); a disk write is handed to the writer with the
//!   offload jobs it must wait for, so the step does not wait.
//! - A host block is overwritten (by an offload or a disk read) only after every queued disk
//!   write reading it finished, and a disk slot is read only after every queued write into it.
//! - The GPU blocks an offload reads are not overwritten while it runs: vLLM frees a request's
//!   blocks only after `finished_sending` (reported once its offloads completed) or, on
//!   preemption, right after `handle_preemptions`, which waits for the preempted requests'
//!   offloads.
//!   The block manager holds an offload's GPU blocks in the job's callback until its batch
//!   completed.
//! - A block whose onboard fails, or whose host copy is bad (its offload or disk read failed),
//!   is reported as failed and never served; a GPU block whose onboard failed in this step is
//!   not offloaded (its host block is marked bad instead).
//! - Every queue has a bound: copy batches (`TransferLimits`), disk writes
//!   ([`DISK_WRITES_QUEUED_MAX`]), asynchronous onboards ([`ASYNC_ONBOARDS_QUEUED_MAX`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::Sender;
use kvbm_cuda::{
    BackendChoice, Device, Direction, GpuRegion, HostRegion, HostRegionOptions, Region,
};
use kvbm_disk::{DiskStore, Lookup, WriteOutcome};
use parking_lot::{Condvar, Mutex};

use crate::copy::{CopyEngine, CopyJob, CopySide, CopyTicket, OnBatch};
use crate::disk::{handoff, store_options, DiskOptions};
use crate::layout::{BlockLayout, KvLayout, TensorView};
use crate::metrics::{add, Metrics};
use crate::plan::{
    AsyncOnboard, DiskRead, DiskWrite, SharedRead, SharedWrite, StepPlan, StepReport,
};
use crate::shared::store::SharedPut;
use crate::shared::{SharedCounts, SharedOptions, SharedStore};
use crate::transfer::TransferLimits;
use crate::CoreError;

/// Block pairs: `(gpu, host)` for offloads, `(host, gpu)` for onboards.
type Pairs = Vec<(u32, u32)>;

/// Disk writes queued for the writer at most; a step with more waits for it to catch up.
pub const DISK_WRITES_QUEUED_MAX: usize = 1024;
/// Asynchronous onboards queued at most; more wait for a loader.
pub const ASYNC_ONBOARDS_QUEUED_MAX: usize = 256;
/// Shared-tier writes queued for the shared writer at most; a step with more waits for it.
pub const SHARED_WRITES_QUEUED_MAX: usize = 1024;
/// Shared-tier blocks read per round trip (each round bounded by the read timeout).
pub const SHARED_READ_CHUNK_BLOCKS: usize = 16;

/// A worker's shared tier: where the store is and the key fingerprint of this rank's shard
/// ([`crate::shared::shard_fingerprint`], which the leader computes too).
#[derive(Debug, Clone)]
pub struct SharedWorkerOptions {
    /// The store's options.
    pub options: SharedOptions,
    /// This rank's key fingerprint.
    pub key_fingerprint: u64,
}

/// What a worker holds besides the engine's GPU memory.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// Blocks of this rank's shard of the host pool (at least 1).
    pub host_blocks: usize,
    /// Copy batching and concurrency (`DYN_KVBM_MAX_TRANSFER_BATCH_SIZE`,
    /// `DYN_KVBM_MAX_CONCURRENT_TRANSFERS`).
    pub limits: TransferLimits,
    /// Asynchronous onboards running at once (each its own disk reads and copies).
    pub async_onboards_max: usize,
    /// This rank's disk tier, if any (what the file held is offered to the leader through
    /// [`Worker::take_recovered_disk`]).
    pub disk: Option<DiskOptions>,
    /// How long a copy may wait for its host memory to be pinned.
    pub host_ready_timeout: Duration,
    /// Threads pinning the host pool.
    pub pin_threads: usize,
    /// This rank's shared tier, if any.
    pub shared: Option<SharedWorkerOptions>,
}

impl Default for WorkerOptions {
    fn default() -> Self {
        Self {
            host_blocks: 1,
            limits: TransferLimits::default(),
            async_onboards_max: 4,
            disk: None,
            host_ready_timeout: Duration::from_secs(300),
            pin_threads: HostRegionOptions::default().pin_threads,
            shared: None,
        }
    }
}

/// Whether every byte of `[addr, addr + len)` lies in mappings of this process that are
/// writable (per `/proc/self/maps`): host memory the emulated device is to load blocks into
/// must be, or the load faults. An address range outside every mapping is not writable.
pub fn host_range_writable(addr: u64, len: u64) -> Result<bool, CoreError> {
    let maps = std::fs::read_to_string("/proc/self/maps")
        .map_err(|e| CoreError::InvalidArgument(format!("/proc/self/maps: {e}")))?;
    Ok(range_writable_in(&maps, addr, len))
}

/// The index of the first of `ranges` (address, bytes) that does not lie inside this process's
/// writable mappings, or `None` when all do. `/proc/self/maps` is read once for all of them.
pub fn first_unwritable_range(ranges: &[(u64, u64)]) -> Result<Option<usize>, CoreError> {
    let maps = std::fs::read_to_string("/proc/self/maps")
        .map_err(|e| CoreError::InvalidArgument(format!("/proc/self/maps: {e}")))?;
    Ok(ranges
        .iter()
        .position(|&(addr, len)| !range_writable_in(&maps, addr, len)))
}

/// [`host_range_writable`] over the text of a `maps` file.
fn range_writable_in(maps: &str, addr: u64, len: u64) -> bool {
    let Some(end) = addr.checked_add(len) else {
        return false;
    };
    let mut writable: Vec<(u64, u64)> = maps
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (range, perms) = (fields.next()?, fields.next()?);
            let (start, stop) = range.split_once('-')?;
            let start = u64::from_str_radix(start, 16).ok()?;
            let stop = u64::from_str_radix(stop, 16).ok()?;
            (perms.as_bytes().get(1) == Some(&b'w')).then_some((start, stop))
        })
        .collect();
    writable.sort_unstable();
    // Walk the writable mappings in order, extending the covered prefix of the range.
    let mut at = addr;
    for (start, stop) in writable {
        if at >= end {
            break;
        }
        if start <= at && stop > at {
            at = stop;
        }
    }
    at >= end
}

/// Checks that every byte `view` addresses lies inside `[base, base + bytes)`, the memory the
/// tensor owns (its storage), so that no address or size from the engine is used unchecked.
pub fn check_view_within(view: &TensorView, base: u64, bytes: u64) -> Result<(), CoreError> {
    match view.span() {
        Some((start, len))
            if start >= base
                && base
                    .checked_add(bytes)
                    .is_some_and(|end| start + len as u64 <= end) =>
        {
            Ok(())
        }
        span => Err(CoreError::InvalidLayout(format!(
            "KV cache tensor {:?} of shape {:?}, strides {:?} and {} bytes per element addresses \
             {span:?} (start, bytes), outside its storage ({base:#x}, {bytes} bytes)",
            view.name, view.shape, view.strides, view.elem_bytes
        ))),
    }
}

struct PendingOffload {
    ticket: CopyTicket,
    pairs: Vec<(u32, u32)>,
    requests: Vec<String>,
    host_blocks: HashSet<u32>,
}

struct PendingOnboard {
    ticket: CopyTicket,
    gpu_blocks: Vec<u32>,
}

/// Blocks whose content is bad: host blocks (a failed offload or disk read into them), and what
/// went bad since the last report, for the leader to drop.
#[derive(Debug, Default)]
struct BadBlocks {
    host: HashSet<u32>,
    /// Registered host blocks whose offload failed (the leader's registry points at garbage).
    reported_host: Vec<u32>,
    /// Disk blocks whose write failed or whose read failed verification.
    reported_disk: Vec<u32>,
}

impl BadBlocks {
    /// A host block the leader registered holds garbage.
    fn offload_failed(&mut self, host: u32) {
        self.host.insert(host);
        self.reported_host.push(host);
    }

    /// Staging host blocks whose disk reads did not land (refused, failed, never run): never
    /// served here, and reported so that the leader never registers them (`Leader::discard`
    /// before `Leader::release`).
    fn staging_unfilled(&mut self, hosts: impl IntoIterator<Item = u32>) {
        for h in hosts {
            self.host.insert(h);
            self.reported_host.push(h);
        }
    }
}

type SharedBad = Arc<Mutex<BadBlocks>>;

/// Disk writes queued or running, by the host block they read and the slot they write.
#[derive(Default)]
struct DiskPending {
    by_host: HashMap<u32, usize>,
    by_slot: HashMap<u32, usize>,
}

impl DiskPending {
    fn busy(&self, host: Option<u32>, slot: Option<u32>) -> bool {
        host.is_some_and(|h| self.by_host.contains_key(&h))
            || slot.is_some_and(|d| self.by_slot.contains_key(&d))
    }

    fn add(&mut self, host: u32, slot: u32) {
        *self.by_host.entry(host).or_insert(0) += 1;
        *self.by_slot.entry(slot).or_insert(0) += 1;
    }

    fn done(&mut self, host: u32, slot: u32) {
        for (map, k) in [(&mut self.by_host, host), (&mut self.by_slot, slot)] {
            if let Some(n) = map.get_mut(&k) {
                *n -= 1;
                if *n == 0 {
                    map.remove(&k);
                }
            }
        }
    }
}

/// The disk side, shared with the writer and the loaders. Declares `store` before
/// `host_region`: the store (and its registration of the region) drops first.
struct DiskShared {
    store: DiskStore,
    host_layout: BlockLayout,
    host_region: HostRegion,
    pending: Mutex<DiskPending>,
    pending_cv: Condvar,
    metrics: Arc<Metrics>,
    registered: Mutex<Option<bool>>,
    registered_cv: Condvar,
    bad: SharedBad,
}

impl DiskShared {
    fn wait_for_writes(&self, host: Option<u32>, slot: Option<u32>) {
        let mut p = self.pending.lock();
        while p.busy(host, slot) {
            self.pending_cv.wait(&mut p);
        }
    }

    /// Reads disk blocks into host blocks, zero-copy, each after the queued writes of its slot
    /// or from its host block; returns the host blocks that missed (a block that fails its
    /// checks, another key, an I/O error).
    fn read_into_host(&self, reads: &[DiskRead]) -> Vec<u32> {
        let mut seen = HashSet::with_capacity(reads.len());
        if !reads.iter().all(|r| seen.insert(r.host)) {
            // Two reads into one host block: whichever landed last, one of them would be served
            // the other's bytes. A plan never asks that; refuse it whole.
            tracing::warn!(
                blocks = reads.len(),
                "disk reads name a host block twice; none served"
            );
            self.bad
                .lock()
                .staging_unfilled(reads.iter().map(|r| r.host));
            return reads.iter().map(|r| r.host).collect();
        }
        for r in reads {
            self.wait_for_writes(Some(r.host), Some(r.disk));
        }
        let items: Vec<(u32, u64, u32)> = reads.iter().map(|r| (r.disk, r.key, r.host)).collect();
        add(&self.metrics.disk_read_blocks, reads.len() as u64);
        let read = |items: &[(u32, u64, u32)]| {
            handoff::read_host_ids(&self.store, &self.host_layout, &self.host_region, items)
        };
        let mut lookups = read(&items).unwrap_or_else(|err| {
            tracing::warn!(error = %err, blocks = reads.len(), "disk read refused");
            vec![Lookup::Miss(kvbm_disk::Miss::Io(err.to_string())); items.len()]
        });
        // One failed I/O fails the reads submitted with it: read those block by block to tell
        // exactly which missed.
        for (item, lookup) in items.iter().zip(lookups.iter_mut()) {
            if matches!(lookup, Lookup::Miss(kvbm_disk::Miss::Io(_))) {
                if let Ok(mut one) = read(std::slice::from_ref(item)) {
                    *lookup = one.remove(0);
                }
            }
        }
        let missed: Vec<(&DiskRead, &Lookup)> = reads
            .iter()
            .zip(&lookups)
            .filter(|(_, l)| !matches!(l, Lookup::Hit))
            .collect();
        add(&self.metrics.disk_read_misses, missed.len() as u64);
        let mut bad = self.bad.lock();
        for r in reads {
            bad.host.remove(&r.host);
        }
        for (r, lookup) in &missed {
            bad.host.insert(r.host);
            // The leader registers a staging block once its onboard finished: it must know
            // this one holds nothing.
            bad.reported_host.push(r.host);
            // A block that failed verification stays bad on disk: the leader drops it. (A slot
            // that holds another key, or an I/O error, says nothing certain about the block.)
            if matches!(lookup, Lookup::Miss(kvbm_disk::Miss::Mismatch(_))) {
                bad.reported_disk.push(r.disk);
            }
        }
        missed.iter().map(|(r, _)| r.host).collect()
    }

    /// Runs one write job: waits for the offloads into its host blocks, skips (and reports)
    /// the writes of host blocks whose offload failed, writes the rest.
    fn write_job(&self, job: WriteJob) {
        let mut failed_hosts = HashSet::new();
        for (ticket, pairs) in &job.after {
            for r in ticket.wait().failed {
                failed_hosts.extend(pairs[r].iter().map(|&(_, h)| h));
            }
        }
        let (skipped, writes): (Vec<DiskWrite>, Vec<DiskWrite>) = {
            let mut bad = self.bad.lock();
            let (skipped, writes): (Vec<DiskWrite>, Vec<DiskWrite>) = job
                .writes
                .into_iter()
                .partition(|w| failed_hosts.contains(&w.host) || bad.host.contains(&w.host));
            // A write of garbage is not made; the leader registered these disk blocks, so
            // they are reported bad.
            bad.reported_disk.extend(skipped.iter().map(|w| w.disk));
            (skipped, writes)
        };
        if !skipped.is_empty() {
            add(&self.metrics.disk_write_failures, skipped.len() as u64);
            let mut p = self.pending.lock();
            for w in &skipped {
                p.done(w.host, w.disk);
            }
            drop(p);
            self.pending_cv.notify_all();
        }
        self.write_batch(writes);
    }

    /// Writes host blocks to disk, zero-copy; a host block written twice in one batch goes in
    /// two calls (its header room is written by one write at a time).
    fn write_batch(&self, writes: Vec<DiskWrite>) {
        let mut rest = writes;
        while !rest.is_empty() {
            let mut seen = HashSet::new();
            let (now, later): (Vec<DiskWrite>, Vec<DiskWrite>) =
                rest.into_iter().partition(|w| seen.insert(w.host));
            rest = later;
            let items: Vec<handoff::HostWrite<'_>> = now
                .iter()
                .map(|w| handoff::HostWrite {
                    host: w.host,
                    slot: w.disk,
                    key: w.key,
                    metadata: &w.identity,
                })
                .collect();
            let outcomes =
                handoff::write_host_ids(&self.store, &self.host_layout, &self.host_region, &items);
            let failed: Vec<u32> = now
                .iter()
                .zip(&outcomes)
                .filter(|(_, o)| !matches!(o, WriteOutcome::Stored))
                .map(|(w, _)| w.disk)
                .collect();
            let stored = items.len() - failed.len();
            self.bad.lock().reported_disk.extend(failed);
            add(&self.metrics.offload_blocks_h2d, stored as u64);
            add(
                &self.metrics.disk_write_failures,
                (items.len() - stored) as u64,
            );
            let mut p = self.pending.lock();
            for w in &now {
                p.done(w.host, w.disk);
            }
            drop(p);
            self.pending_cv.notify_all();
        }
    }
}

/// Disk writes for the writer, with the offload jobs into their host blocks to wait for first.
struct WriteJob {
    writes: Vec<DiskWrite>,
    after: Vec<(CopyTicket, Pairs)>,
}

/// The shared tier's side of a worker: its store, and the host blocks queued writes still
/// have to copy out (nothing overwrites them meanwhile).
struct SharedSide {
    store: SharedStore,
    host_layout: BlockLayout,
    host_region: HostRegion,
    host_stride: usize,
    ready_timeout: Duration,
    payload_bytes: usize,
    pending: Mutex<HashMap<u32, usize>>,
    pending_cv: Condvar,
    metrics: Arc<Metrics>,
    bad: SharedBad,
}

/// Shared-tier writes for the shared writer, with the offload jobs into their host blocks.
struct SharedJob {
    writes: Vec<SharedWrite>,
    after: Vec<(CopyTicket, Pairs)>,
}

impl SharedSide {
    fn wait_for_writes(&self, host: u32) {
        let mut p = self.pending.lock();
        while p.contains_key(&host) {
            self.pending_cv.wait(&mut p);
        }
    }

    fn done(&self, host: u32) {
        let mut p = self.pending.lock();
        if let Some(n) = p.get_mut(&host) {
            *n -= 1;
            if *n == 0 {
                p.remove(&host);
            }
        }
        drop(p);
        self.pending_cv.notify_all();
    }

    /// Host block `id`'s bytes in canonical order.
    fn copy_out(&self, id: u32) -> Result<Vec<u8>, CoreError> {
        let mut out = vec![0u8; self.payload_bytes];
        let mut result = Ok(());
        let base = self.host_region.addr();
        self.host_layout
            .for_each_run(id as usize, |addr, offset, len, _| {
                if result.is_ok() {
                    result = self
                        .host_region
                        .read((addr - base) as usize, &mut out[offset..offset + len]);
                }
            });
        result.map(|_| out).map_err(CoreError::from)
    }

    /// Writes `payload` (canonical order) into host block `id`.
    fn copy_in(&self, id: u32, payload: &[u8]) -> Result<(), CoreError> {
        let mut result = Ok(());
        let base = self.host_region.addr();
        self.host_layout
            .for_each_run(id as usize, |addr, offset, len, _| {
                if result.is_ok() {
                    result = self
                        .host_region
                        .write((addr - base) as usize, &payload[offset..offset + len]);
                }
            });
        result.map_err(CoreError::from)
    }

    /// Runs one write job: waits for the offloads into its host blocks, copies each block that
    /// holds good bytes out of the host pool (then it may be overwritten), and queues the
    /// copies with the store (which sends them in pipelined batches and never waits).
    fn write_job(&self, job: SharedJob) {
        let hosts: Vec<u32> = job.writes.iter().map(|w| w.host).collect();
        let done = std::sync::atomic::AtomicUsize::new(0);
        let run = std::panic::AssertUnwindSafe(|| self.write_job_inner(job, &done));
        if std::panic::catch_unwind(run).is_err() {
            // Never leave a host block waited for by nobody: the rest of the job is released.
            tracing::error!("shared tier: a write job panicked; its blocks are not written");
            for &h in &hosts[done.load(std::sync::atomic::Ordering::Relaxed)..] {
                self.done(h);
            }
        }
    }

    fn write_job_inner(&self, job: SharedJob, done: &std::sync::atomic::AtomicUsize) {
        let mut failed_hosts = HashSet::new();
        for (ticket, pairs) in &job.after {
            for r in ticket.wait().failed {
                failed_hosts.extend(pairs[r].iter().map(|&(_, h)| h));
            }
        }
        // Runs of one tenant, in order: the store keeps what it queues a prefix of each run.
        // A run's host blocks are released once the store has taken the run (so that
        // `wait_shared` never finds a copied block that is not yet in the store's hands), in
        // the job's order (which `write_job` relies on after a panic).
        let mut run: Vec<SharedPut> = Vec::new();
        let mut run_hosts: Vec<u32> = Vec::new();
        let release = |hosts: &mut Vec<u32>| {
            for h in hosts.drain(..) {
                self.done(h);
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        };
        let mut tenant = None;
        let mut queued = 0;
        for w in job.writes {
            let bad = failed_hosts.contains(&w.host) || self.bad.lock().host.contains(&w.host);
            let down = !self.store.usable();
            if down && !bad {
                // Not copied for nothing: the store would drop it.
                self.store.count_dropped_down(1);
            }
            let put = if bad || down {
                None
            } else {
                let identity =
                    crate::disk::decode_identity(kvbm_events::SequenceHash(w.key), &w.identity);
                match (identity, self.copy_out(w.host)) {
                    (Some(identity), Ok(bytes)) => Some(SharedPut {
                        identity,
                        payload: Arc::from(bytes),
                    }),
                    _ => None,
                }
            };
            if tenant != Some(w.tenant) || put.is_none() {
                if let Some(t) = tenant {
                    queued += self.store.write(t, &run);
                }
                run.clear();
                release(&mut run_hosts);
                tenant = Some(w.tenant);
            }
            run_hosts.push(w.host);
            match put {
                Some(put) => run.push(put),
                None => release(&mut run_hosts),
            }
        }
        if let Some(t) = tenant {
            queued += self.store.write(t, &run);
        }
        release(&mut run_hosts);
        add(&self.metrics.shared_write_blocks, queued as u64);
    }

    /// Reads shared blocks into staging host blocks (after the queued writes reading those
    /// host blocks, shared and disk); returns the host blocks that missed (not there, refused
    /// by its checks, the tier out or late).
    fn read_into_host(
        &self,
        tenant: u64,
        reads: &[SharedRead],
        disk: Option<&DiskShared>,
    ) -> Vec<u32> {
        let hosts: Vec<u32> = reads.iter().map(|r| r.host).collect();
        let mut seen = HashSet::with_capacity(reads.len());
        if !hosts.iter().all(|h| seen.insert(*h)) {
            tracing::warn!(
                blocks = reads.len(),
                "shared reads name a host block twice; none served"
            );
            self.bad.lock().staging_unfilled(hosts.iter().copied());
            return hosts;
        }
        for &h in &hosts {
            self.wait_for_writes(h);
            if let Some(d) = disk {
                d.wait_for_writes(Some(h), None);
            }
        }
        let end = hosts.iter().copied().max().unwrap_or(0) as usize + 1;
        let ready = self
            .host_region
            .wait_ready(end * self.host_stride, self.ready_timeout);
        add(&self.metrics.shared_read_blocks, reads.len() as u64);
        let mut missed = Vec::new();
        // In chunks, each bounded by the read timeout and copied in as it lands: a long prefix
        // neither waits on one deadline nor holds all its values at once. After a chunk that
        // missed, the rest is not asked for (the load fails from there anyway).
        let mut failed = !ready;
        for chunk in reads.chunks(SHARED_READ_CHUNK_BLOCKS) {
            if failed {
                missed.extend(chunk.iter().map(|r| r.host));
                continue;
            }
            let keys: Vec<kvbm_events::SequenceHash> = chunk
                .iter()
                .map(|r| kvbm_events::SequenceHash(r.key))
                .collect();
            for (r, block) in chunk.iter().zip(self.store.read(tenant, &keys)) {
                let landed = block.is_some_and(|b| self.copy_in(r.host, b.payload()).is_ok());
                if !landed {
                    missed.push(r.host);
                    failed = true;
                }
            }
        }
        add(&self.metrics.shared_read_misses, missed.len() as u64);
        let mut bad = self.bad.lock();
        for &h in &hosts {
            bad.host.remove(&h);
        }
        bad.staging_unfilled(missed.iter().copied());
        missed
    }
}

struct SharedTier {
    side: Arc<SharedSide>,
    jobs: Option<Sender<SharedJob>>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for SharedTier {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct DiskSide {
    shared: Arc<DiskShared>,
    /// What the file held when it opened, `(slot, key, metadata)`, until taken.
    recovered: Vec<(u32, u64, Vec<u8>)>,
    jobs: Option<Sender<WriteJob>>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for DiskSide {
    fn drop(&mut self) {
        // Finish queued writes, then leave a checkpoint so that the next start need not scan.
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Err(err) = self.shared.store.checkpoint() {
            tracing::warn!(error = %err, "could not write the disk checkpoint; the next start scans");
        }
    }
}

/// A finished asynchronous onboard: (request, GPU blocks that failed).
type OnboardDone = (String, Vec<u32>);

/// What a loader needs of the worker.
struct LoaderContext {
    copies: Arc<CopyEngine>,
    host: HostRegion,
    host_stride: usize,
    ready_timeout: Duration,
    disk: Option<Arc<DiskShared>>,
    shared: Option<Arc<SharedSide>>,
    bad: SharedBad,
    metrics: Arc<Metrics>,
    done: Mutex<Vec<OnboardDone>>,
    busy: Mutex<usize>,
    busy_cv: Condvar,
}

impl LoaderContext {
    /// Runs one asynchronous onboard; returns the GPU blocks that did not get their bytes.
    fn run(&self, job: &AsyncOnboard) -> Vec<u32> {
        // This job's own misses, not the shared bad set: another job may reuse and refill a
        // host block reported bad here once the leader dropped it.
        let mut missed: HashSet<u32> = HashSet::new();
        if !job.disk_reads.is_empty() {
            match &self.disk {
                Some(disk) => missed.extend(disk.read_into_host(&job.disk_reads)),
                None => {
                    let hosts: Vec<u32> = job.disk_reads.iter().map(|r| r.host).collect();
                    self.bad.lock().staging_unfilled(hosts.iter().copied());
                    missed.extend(hosts);
                }
            }
        }
        if !job.shared_reads.is_empty() {
            match &self.shared {
                Some(shared) => missed.extend(shared.read_into_host(
                    job.tenant,
                    &job.shared_reads,
                    self.disk.as_deref(),
                )),
                None => {
                    let hosts: Vec<u32> = job.shared_reads.iter().map(|r| r.host).collect();
                    self.bad.lock().staging_unfilled(hosts.iter().copied());
                    missed.extend(hosts);
                }
            }
        }
        let (bad, good): (Pairs, Pairs) = {
            let bad = self.bad.lock();
            job.pairs
                .iter()
                .partition(|(h, _)| missed.contains(h) || bad.host.contains(h))
        };
        let mut failed: Vec<u32> = bad.iter().map(|&(_, g)| g).collect();
        // Blocks the leader promised but could not back fail with the job (a hybrid model's
        // onboard: vLLM takes no block-level load error then, only a failed request).
        failed.extend(&job.unbacked);
        if good.is_empty() {
            return failed;
        }
        let end = good.iter().map(|&(h, _)| h).max().unwrap_or(0) as usize + 1;
        let outcome = if self
            .host
            .wait_ready(end * self.host_stride, self.ready_timeout)
        {
            self.copies
                .submit(
                    CopyJob {
                        direction: Direction::HostToDevice,
                        pairs: good.clone(),
                        stage: None,
                    },
                    None,
                    true,
                )
                .map(|t| t.wait())
        } else {
            Err(CoreError::TransferFailed(
                "host memory not pinned in time".into(),
            ))
        };
        match outcome {
            Ok(o) => {
                for r in &o.failed {
                    failed.extend(good[r.clone()].iter().map(|&(_, g)| g));
                }
                let ok = good.len() - o.failed.iter().map(|r| r.len()).sum::<usize>();
                let from_disk: HashSet<u32> = job
                    .disk_reads
                    .iter()
                    .map(|r| r.host)
                    .chain(job.shared_reads.iter().map(|r| r.host))
                    .collect();
                let d2d = good.iter().filter(|(h, _)| from_disk.contains(h)).count();
                add(&self.metrics.onboard_blocks_d2d, d2d.min(ok) as u64);
                add(
                    &self.metrics.onboard_blocks_h2d,
                    ok.saturating_sub(d2d) as u64,
                );
            }
            Err(err) => {
                tracing::warn!(request = %job.request, error = %err, "asynchronous onboard failed");
                failed.extend(good.iter().map(|&(_, g)| g));
            }
        }
        failed
    }
}

/// The threads running asynchronous onboards; dropping it waits for them.
struct Loaders {
    context: Arc<LoaderContext>,
    jobs: Option<Sender<AsyncOnboard>>,
    threads: Vec<JoinHandle<()>>,
}

impl Drop for Loaders {
    fn drop(&mut self) {
        self.jobs.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Copy counters of one worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkerStats {
    /// Bytes offloaded (GPU to host) by completed batches.
    pub bytes_offloaded: u64,
    /// Bytes onboarded (host to GPU) by completed batches.
    pub bytes_onboarded: u64,
    /// Offload jobs not settled yet.
    pub offloads_in_flight: usize,
    /// Times a preemption, an onboard or a disk operation waited for an offload in flight.
    pub offload_waits: u64,
    /// Host blocks whose content is bad (failed offload or disk read).
    pub bad_host_blocks: usize,
    /// Bytes of the host pool pinned so far.
    pub host_ready_bytes: usize,
    /// Disk writes queued or running.
    pub disk_writes_pending: usize,
}

/// One rank's physical half of the split engine.
pub struct Worker {
    device: Device,
    kv: KvLayout,
    gpu: BlockLayout,
    /// Per registered tensor (layer), the onboard stage that brings its bytes in.
    ready_after: Vec<u32>,
    /// The onboard stages, ascending: the last layers of a block's runs.
    stages: Vec<u32>,
    /// Declared before the copy engine and the disk: dropped (and joined) first.
    loaders: Option<Loaders>,
    disk: Option<DiskSide>,
    shared: Option<SharedTier>,
    copies: Arc<CopyEngine>,
    host: HostRegion,
    host_layout: BlockLayout,
    metrics: Arc<Metrics>,
    ready_timeout: Duration,
    offloads: Vec<PendingOffload>,
    /// Offload jobs not settled yet, per request.
    offload_pending: HashMap<String, usize>,
    /// Requests whose offloads all settled since the last poll.
    offload_done: Vec<String>,
    /// The onboards in flight, per stage (indexed by the stage's layer).
    onboards: Vec<Option<PendingOnboard>>,
    failed: Vec<u32>,
    bad: SharedBad,
    bytes_offloaded: u64,
    bytes_onboarded: u64,
    offload_waits: u64,
    // vLLM's step: the bound plan and the request bookkeeping of `get_finished`.
    plan: Option<StepPlan>,
    /// vLLM's sleep mode unregistered the KV caches: no copy touches GPU memory until
    /// [`Worker::remap_gpu`].
    suspended: bool,
    /// Requests that ever offloaded (their finish waits for their offloads).
    offloaded: HashSet<String>,
    /// Finished requests waiting for their offloads.
    finished_waiting: HashSet<String>,
    /// The bound step started offloads (`start_offloads`), for [`Worker::fence_offloads`].
    step_offloaded: bool,
    /// Requests whose asynchronous onboards finished with failed blocks, reported since the
    /// last [`Worker::take_failed_onboards`], with those blocks.
    failed_onboards: Vec<(String, Vec<u32>)>,
}

/// How [`Worker::fence_offloads`] kept the engine from reusing a step's offload sources.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OffloadFence {
    /// Not needed: the plan did not ask for it, or the step offloaded nothing.
    None,
    /// The engine's stream waits for the offloads on the device; the host did not wait.
    Device,
    /// The host waited for the offloads (the emulated device, no engine stream, or a driver
    /// that refused the device-side wait).
    Host,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("kv", &self.kv)
            .field("runs_per_block", &self.gpu.runs_per_block())
            .field("gpu_blocks", &self.gpu.num_blocks())
            .field("host_blocks", &self.host_layout.num_blocks())
            .field("device", &self.device.kind().as_str())
            .finish()
    }
}

/// Opens the device an engine's tensors live on (`auto`, `cuda` or `emulated`).
pub fn open_device(choice: &str, index: usize) -> Result<Device, CoreError> {
    let choice: BackendChoice = choice.parse()?;
    Ok(Device::open(choice, index)?)
}

/// The kind of device this process would use for rank 0 (`KVBM_DEVICE`, or CUDA when a driver
/// and a GPU are present, else the emulated device).
pub fn default_device_kind() -> Result<&'static str, CoreError> {
    Ok(Device::from_env(0)?.kind().as_str())
}

impl Worker {
    /// Registers the engine's GPU memory that `spans` (from [`BlockLayout::from_views`]) cover.
    ///
    /// # Safety
    /// Every span must be memory the engine owns (each tensor checked with
    /// [`check_view_within`]), and it must stay allocated for as long as the returned regions
    /// (and so the worker and every copy it queued) live.
    #[allow(unsafe_code)]
    pub unsafe fn register_spans(
        device: &Device,
        spans: &[(u64, usize)],
        device_index: usize,
    ) -> Result<Vec<GpuRegion>, CoreError> {
        let mut regions = Vec::with_capacity(spans.len());
        for &(addr, len) in spans {
            // SAFETY: the caller's contract above.
            regions.push(unsafe { device.register_gpu(addr, len, device_index) }?);
        }
        Ok(regions)
    }

    /// A worker over the engine's GPU memory (`gpu` laid out as `gpu_layout`), mapping a pinned
    /// host pool (pinned in the background; copies wait for the blocks they touch) and opening
    /// the disk tier if configured.
    pub fn new(
        device: Device,
        kv: KvLayout,
        gpu_layout: BlockLayout,
        gpu: Vec<GpuRegion>,
        options: WorkerOptions,
        metrics: Arc<Metrics>,
    ) -> Result<Self, CoreError> {
        if options.host_blocks == 0 || gpu_layout.num_blocks() == 0 {
            return Err(CoreError::InvalidArgument(format!(
                "{} GPU blocks and {} host blocks: both must be above 0",
                gpu_layout.num_blocks(),
                options.host_blocks
            )));
        }
        if options.host_blocks >= u32::MAX as usize {
            return Err(CoreError::InvalidArgument(format!(
                "{} host blocks: block ids are 32-bit",
                options.host_blocks
            )));
        }
        let host_bytes = options
            .host_blocks
            .checked_mul(kv.host_stride_bytes())
            .ok_or_else(|| CoreError::InvalidArgument("host pool size overflows".into()))?;
        // Whole blocks per pinned chunk: no block straddles two CUDA registrations.
        let host = device.alloc_host(
            host_bytes,
            crate::manager::host_pin_options(kv.host_stride_bytes(), options.pin_threads),
        )?;
        let host_layout = BlockLayout::host(kv, options.host_blocks, host.addr());
        let ready_after = gpu_layout.ready_after();
        let mut stages = Vec::new();
        gpu_layout.for_each_run(0, |_, _, _, (_, last)| stages.push(last));
        stages.sort_unstable();
        stages.dedup();
        let copies = Arc::new(CopyEngine::new(
            CopySide {
                layout: gpu_layout.clone(),
                regions: gpu.into_iter().map(Region::from).collect(),
            },
            CopySide {
                layout: host_layout.clone(),
                regions: vec![Region::from(host.clone())],
            },
            device.copy_stream_with(Direction::DeviceToHost, options.limits.copy)?,
            device.copy_stream_with(Direction::HostToDevice, options.limits.copy)?,
            options.limits,
            metrics.clone(),
        )?);
        let bad = SharedBad::default();
        let disk = match &options.disk {
            Some(d) if d.blocks > 0 => Some(open_disk(
                d,
                kv,
                gpu_layout.geometry_id(),
                &host_layout,
                &host,
                &metrics,
                &bad,
            )?),
            _ => None,
        };
        let shared = match &options.shared {
            Some(s) => Some(open_shared(
                s,
                kv,
                gpu_layout.geometry_id(),
                &host_layout,
                &host,
                options.host_ready_timeout,
                &metrics,
                &bad,
            )?),
            None => None,
        };
        let loaders = start_loaders(
            Arc::new(LoaderContext {
                copies: copies.clone(),
                host: host.clone(),
                host_stride: kv.host_stride_bytes(),
                ready_timeout: options.host_ready_timeout,
                disk: disk.as_ref().map(|d| d.shared.clone()),
                shared: shared.as_ref().map(|s| s.side.clone()),
                bad: bad.clone(),
                metrics: metrics.clone(),
                done: Mutex::new(Vec::new()),
                busy: Mutex::new(0),
                busy_cv: Condvar::new(),
            }),
            options.async_onboards_max.max(1),
        )?;
        let n_tensors = ready_after.len();
        Ok(Self {
            device,
            kv,
            gpu: gpu_layout,
            ready_after,
            stages,
            loaders: Some(loaders),
            disk,
            shared,
            copies,
            host,
            host_layout,
            metrics,
            ready_timeout: options.host_ready_timeout,
            offloads: Vec::new(),
            offload_pending: HashMap::new(),
            offload_done: Vec::new(),
            bad,
            onboards: (0..n_tensors).map(|_| None).collect(),
            failed: Vec::new(),
            bytes_offloaded: 0,
            bytes_onboarded: 0,
            offload_waits: 0,
            plan: None,
            offloaded: HashSet::new(),
            finished_waiting: HashSet::new(),
            step_offloaded: false,
            failed_onboards: Vec::new(),
            suspended: false,
        })
    }

    // -- what the worker is ---------------------------------------------------------------

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The KV shape of one block.
    pub fn kv(&self) -> KvLayout {
        self.kv
    }

    /// Where the GPU blocks are.
    pub fn gpu_layout(&self) -> &BlockLayout {
        &self.gpu
    }

    /// Host blocks of this rank's shard.
    pub fn host_blocks(&self) -> usize {
        self.host_layout.num_blocks()
    }

    /// Registered tensors (layers).
    pub fn num_tensors(&self) -> usize {
        self.ready_after.len()
    }

    /// Disk blocks of this rank's file (0 without a disk tier).
    pub fn disk_blocks(&self) -> usize {
        self.disk.as_ref().map_or(0, |d| d.shared.store.slots())
    }

    /// The disk store, if any.
    pub fn disk_store(&self) -> Option<&DiskStore> {
        self.disk.as_ref().map(|d| &d.shared.store)
    }

    /// Whether the host pool got registered for fixed-buffer disk I/O (None: not decided yet, or
    /// no disk tier).
    pub fn disk_registered(&self) -> Option<bool> {
        self.disk.as_ref().and_then(|d| *d.shared.registered.lock())
    }

    /// Waits up to `timeout` for the host pool's registration for fixed-buffer disk I/O (done
    /// in the background once the pool is pinned): `Some(true)` registered, `Some(false)` it
    /// failed, `None` not decided yet or no disk tier.
    pub fn wait_disk_registered(&self, timeout: Duration) -> Option<bool> {
        let disk = self.disk.as_ref()?;
        let mut registered = disk.shared.registered.lock();
        if registered.is_none() {
            let _ = disk.shared.registered_cv.wait_for(&mut registered, timeout);
        }
        *registered
    }

    /// What the disk file held when it opened, `(disk block, key, metadata)` (taken: a second
    /// call returns nothing), for a leader to adopt ([`crate::Leader::adopt_disk`]).
    pub fn take_recovered_disk(&mut self) -> Vec<(u32, u64, Vec<u8>)> {
        self.disk
            .as_mut()
            .map_or_else(Vec::new, |d| std::mem::take(&mut d.recovered))
    }

    /// This rank's pinned host pool.
    pub fn host_region(&self) -> &HostRegion {
        &self.host
    }

    /// Where the host blocks are.
    pub fn host_layout(&self) -> &BlockLayout {
        &self.host_layout
    }

    /// Writes GPU block `id` from `bytes` (exactly one block) in canonical order (the order of
    /// its host copy, see [`crate::layout`]), for tests and benchmarks; not ordered with copies.
    pub fn write_gpu_block(&self, id: u32, bytes: &[u8]) -> Result<(), CoreError> {
        block_io(
            self.kv,
            self.copies.gpu(),
            id,
            bytes.len(),
            |region, offset, range| match region {
                Region::Gpu(g) => g.write(offset, &bytes[range]),
                Region::Host(h) => h.write(offset, &bytes[range]),
            },
        )
    }

    /// Reads GPU block `id` into `out` in canonical order.
    pub fn read_gpu_block(&self, id: u32, out: &mut [u8]) -> Result<(), CoreError> {
        let len = out.len();
        block_io(
            self.kv,
            self.copies.gpu(),
            id,
            len,
            |region, offset, range| read_region(region, offset, &mut out[range]),
        )
    }

    /// Reads host block `id` into `out` in canonical order, after the offloads into it.
    pub fn read_host_block(&mut self, id: u32, out: &mut [u8]) -> Result<(), CoreError> {
        self.wait_offloads_touching(&HashSet::from([id]));
        let len = out.len();
        block_io(
            self.kv,
            self.copies.host(),
            id,
            len,
            |region, offset, range| read_region(region, offset, &mut out[range]),
        )
    }

    /// The copy engine (its streams, limits and queue depths).
    pub fn copies(&self) -> &CopyEngine {
        &self.copies
    }

    /// The counters this worker bumps (shared with whoever exports them).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Copy counters.
    pub fn stats(&self) -> WorkerStats {
        WorkerStats {
            bytes_offloaded: self.bytes_offloaded,
            bytes_onboarded: self.bytes_onboarded,
            offloads_in_flight: self.offloads.len(),
            offload_waits: self.offload_waits,
            bad_host_blocks: self.bad.lock().host.len(),
            host_ready_bytes: self.host.ready_bytes(),
            disk_writes_pending: self.disk.as_ref().map_or(0, |d| {
                d.shared.pending.lock().by_slot.values().sum::<usize>()
            }),
        }
    }

    // -- vLLM's step ----------------------------------------------------------------------

    /// Binds this step's plan (`bind_connector_metadata`).
    pub fn bind(&mut self, plan: StepPlan) {
        self.plan = Some(plan);
        self.step_offloaded = false;
    }

    /// The bound plan, if any.
    pub fn plan(&self) -> Option<&StepPlan> {
        self.plan.as_ref()
    }

    /// Drops the bound plan (`clear_connector_metadata`), after the step's onboards completed
    /// (vLLM waited for each layer already; this makes sure nothing of the step still copies
    /// into host blocks the leader may hand out again).
    pub fn clear(&mut self) {
        let _ = self.wait_onboards();
        self.plan = None;
        self.step_offloaded = false;
    }

    /// Waits for the offloads of the plan's preempted requests, whose GPU blocks vLLM reuses as
    /// soon as this returns (`handle_preemptions`); returns how many offload jobs it waited for.
    pub fn handle_preemptions(&mut self) -> usize {
        let preempted = match &self.plan {
            Some(p) if !p.preempted.is_empty() => p.preempted.clone(),
            _ => return 0,
        };
        self.wait_offloads_of(&preempted)
    }

    /// Orders this worker's later copies in `direction` after everything queued so far on the
    /// engine's CUDA stream `foreign` ([`CopyEngine::order_after_stream`]): called with the
    /// stream vLLM runs the forward pass on, before a step's onboards (`HostToDevice`: their
    /// target blocks may still have writes pending there, e.g. zeroing under asynchronous
    /// scheduling) and before its offloads (`DeviceToHost`: the forward writes the blocks
    /// they read). The host never waits for the GPU.
    pub fn order_after_stream(&self, direction: Direction, foreign: u64) -> Result<(), CoreError> {
        self.copies.order_after_stream(direction, foreign)
    }

    /// Starts the plan's onboards (`start_load_kv`): its disk reads into staging host blocks,
    /// its synchronous onboards (one job per stage), and its asynchronous onboards; the plan's
    /// load errors are reported by [`Self::take_failed`].
    ///
    /// Every part runs even when an earlier one fails: a part that cannot run reports its GPU
    /// blocks as failed (an asynchronous onboard that cannot be queued is reported finished with
    /// all its blocks failed), so vLLM never waits for work that will not come. The first error
    /// is returned after that.
    ///
    /// The onboard parts are taken out of the bound plan (each runs once).
    pub fn start_onboards(&mut self) -> Result<(), CoreError> {
        let Some(plan) = &mut self.plan else {
            return Ok(());
        };
        let load_errors = std::mem::take(&mut plan.load_errors);
        let reads = std::mem::take(&mut plan.disk_reads);
        let pairs: Vec<(u32, u32)> = std::mem::take(&mut plan.onboards)
            .into_iter()
            .flat_map(|o| o.pairs)
            .collect();
        let asyncs = std::mem::take(&mut plan.async_onboards);
        self.failed.extend(load_errors);
        let mut first_error = None;
        if !reads.is_empty() {
            if let Err(e) = self.disk_read(&reads) {
                // The staging blocks hold nothing: their onboards below fail.
                self.bad.lock().host.extend(reads.iter().map(|r| r.host));
                first_error.get_or_insert(e);
            }
        }
        if !pairs.is_empty() {
            if let Err(e) = self.onboard(&pairs) {
                self.failed.extend(pairs.iter().map(|&(_, g)| g));
                first_error.get_or_insert(e);
            }
        }
        for job in asyncs {
            let (request, gpu): (String, Vec<u32>) = (
                job.request.clone(),
                job.pairs.iter().map(|&(_, g)| g).collect(),
            );
            let staged: Vec<u32> = job
                .disk_reads
                .iter()
                .map(|r| r.host)
                .chain(job.shared_reads.iter().map(|r| r.host))
                .collect();
            let unbacked = job.unbacked.clone();
            if let Err(e) = self.onboard_async(job) {
                // Its disk reads never run: the staging blocks hold nothing.
                self.bad.lock().staging_unfilled(staged);
                let loaders = self.loaders.as_ref().expect("present until dropped");
                let mut gpu = gpu;
                gpu.extend(unbacked);
                loaders.context.done.lock().push((request, gpu));
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Starts the plan's offloads after the forward pass (`wait_for_save`), then queues its disk
    /// writes (each after the offloads into its host block).
    ///
    /// The plan's requests are tracked (reported in `finished_sending` once finished) even when
    /// their offload cannot run: its host blocks are then reported bad to the leader. The first
    /// error is returned after everything ran.
    pub fn start_offloads(&mut self) -> Result<(), CoreError> {
        let Some(plan) = &mut self.plan else {
            return Ok(());
        };
        let mut pairs = Vec::new();
        let mut requests = Vec::with_capacity(plan.offloads.len());
        for o in std::mem::take(&mut plan.offloads) {
            pairs.extend(o.pairs);
            requests.push(o.request);
        }
        let writes = std::mem::take(&mut plan.disk_writes);
        let shared_writes = std::mem::take(&mut plan.shared_writes);
        let mut first_error = None;
        if !pairs.is_empty() {
            self.step_offloaded = true;
            self.offloaded.extend(requests.iter().cloned());
            let started = self
                .wait_onboards()
                .and_then(|_| self.offload(&pairs, &requests));
            if let Err(e) = started {
                let nh = self.host_blocks() as u32;
                let mut bad = self.bad.lock();
                for &(_, h) in pairs.iter().filter(|&&(_, h)| h < nh) {
                    bad.offload_failed(h);
                }
                first_error.get_or_insert(e);
            }
        }
        if !writes.is_empty() {
            if let Err(e) = self.disk_write(writes) {
                first_error.get_or_insert(e);
            }
        }
        if !shared_writes.is_empty() {
            if let Err(e) = self.shared_write(shared_writes) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// The fence after a step's offloads (`wait_for_save`, after [`Self::start_offloads`]),
    /// when the bound plan asks for it (`StepPlan::fence_offloads`): vLLM frees sliding-window
    /// and Mamba blocks of running requests without telling the connector and may zero and
    /// overwrite them in the very next step (`remove_skipped_blocks` in every `allocate_slots`,
    /// `vllm/v1/core/kv_cache_manager.py`), while this step's offloads still read them.
    ///
    /// With the engine's CUDA stream `foreign`, that stream waits on the device for every
    /// offload queued so far ([`CopyEngine::make_stream_wait`]): the engine's later work runs
    /// after them and the host does not wait. On the emulated device (whose engine writes
    /// synchronously from the host), without `foreign`, or should the driver refuse, the host
    /// waits for the offloads before returning (slower, never wrong).
    pub fn fence_offloads(&mut self, foreign: Option<u64>) -> OffloadFence {
        let asked = self.plan.as_ref().is_some_and(|p| p.fence_offloads);
        if !asked || !self.step_offloaded {
            return OffloadFence::None;
        }
        if let (Some(foreign), kvbm_cuda::DeviceKind::Cuda) = (foreign, self.device.kind()) {
            match self
                .copies
                .make_stream_wait(Direction::DeviceToHost, foreign)
            {
                Ok(true) => return OffloadFence::Device,
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "the engine's stream cannot wait for the offloads; the host waits");
                }
            }
        }
        // One stream completes in order: waiting for every offload is waiting for this step's.
        self.wait_offloads();
        OffloadFence::Host
    }

    /// Requests whose asynchronous onboards finished with failed GPU blocks, as reported by
    /// [`Self::report`] since the last call, each with those blocks (the blocks are in the
    /// report's `failed_blocks` too). vLLM 0.33 refuses block-level load errors for a model of
    /// several KV cache groups (`_handle_invalid_blocks` in `vllm/v1/core/sched/scheduler.py`)
    /// and takes them per request instead (`KVConnectorTransferResults.failed_recving`).
    pub fn take_failed_onboards(&mut self) -> Vec<(String, Vec<u32>)> {
        std::mem::take(&mut self.failed_onboards)
    }

    /// What finished since the last report (vLLM's `get_finished`, then
    /// `get_block_ids_with_load_errors`): the finished requests (`finished`, vLLM's list for this
    /// step, remembered until then) whose offloads all completed, so that vLLM may free their GPU
    /// blocks (a request that never offloaded is not reported); the requests whose asynchronous
    /// onboards completed; and every GPU block whose onboard failed so far (taken).
    pub fn report(&mut self, finished: &[String]) -> StepReport {
        // Settle what completed; a request is done offloading when no job of it is unsettled
        // (`offload_pending`), whichever path settled its earlier jobs.
        self.poll_offloads();
        for r in finished {
            if self.offloaded.contains(r) {
                self.finished_waiting.insert(r.clone());
            }
        }
        let mut finished_offloading: Vec<String> = self
            .finished_waiting
            .iter()
            .filter(|r| !self.offload_pending.contains_key(*r))
            .cloned()
            .collect();
        finished_offloading.sort_unstable();
        for r in &finished_offloading {
            self.finished_waiting.remove(r);
            self.offloaded.remove(r);
        }
        let mut finished_onboarding = Vec::new();
        for (r, failed) in self.poll_async() {
            if !failed.is_empty() {
                self.failed_onboards.push((r.clone(), failed.clone()));
            }
            finished_onboarding.push(r);
            self.failed.extend(failed);
        }
        let failed_blocks = self.take_failed();
        let (bad_host_blocks, bad_disk_blocks) = {
            let mut bad = self.bad.lock();
            (
                std::mem::take(&mut bad.reported_host),
                std::mem::take(&mut bad.reported_disk),
            )
        };
        StepReport {
            finished_offloading,
            finished_onboarding,
            failed_blocks,
            bad_host_blocks,
            bad_disk_blocks,
        }
    }

    /// vLLM's sleep mode (`unregister_kv_caches`): waits for every copy that touches GPU memory
    /// (offloads, onboards, asynchronous onboards), then refuses any further one until
    /// [`Self::remap_gpu`]; the host pool, the disk tier and what finished but was not reported
    /// yet are kept. Idempotent.
    pub fn suspend(&mut self) {
        self.wait_offloads();
        let _ = self.wait_onboards();
        self.wait_async();
        self.suspended = true;
    }

    /// Whether [`Self::suspend`] was called and no [`Self::remap_gpu`] since.
    pub fn is_suspended(&self) -> bool {
        self.suspended
    }

    /// vLLM's `restore_kv_caches`: the engine's KV cache memory again, possibly at other
    /// addresses, in the same layout (the same geometry, block count and tensor count, or an
    /// error naming both). The copy engine and the loaders are rebuilt on the new regions;
    /// asynchronous onboards that finished while suspended are still reported. Only while
    /// suspended.
    pub fn remap_gpu(
        &mut self,
        kv: KvLayout,
        gpu_layout: BlockLayout,
        gpu: Vec<GpuRegion>,
    ) -> Result<(), CoreError> {
        if !self.suspended {
            return Err(CoreError::InvalidArgument(
                "the KV caches are registered: suspend (unregister) them before restoring".into(),
            ));
        }
        if kv != self.kv
            || gpu_layout.geometry_id() != self.gpu.geometry_id()
            || gpu_layout.num_blocks() != self.gpu.num_blocks()
            || gpu_layout.ready_after().len() != self.ready_after.len()
        {
            return Err(CoreError::InvalidArgument(format!(
                "restored KV caches differ from the registered ones: {kv:?} in {} blocks over {} \
                 tensors, was {:?} in {} blocks over {} tensors",
                gpu_layout.num_blocks(),
                gpu_layout.ready_after().len(),
                self.kv,
                self.gpu.num_blocks(),
                self.ready_after.len()
            )));
        }
        let limits = self.copies.limits();
        let metrics = self.metrics.clone();
        let old = self.loaders.take().expect("present until dropped");
        let done = std::mem::take(&mut *old.context.done.lock());
        let threads = old.threads.len();
        drop(old);
        let copies = CopyEngine::new(
            CopySide {
                layout: gpu_layout.clone(),
                regions: gpu.into_iter().map(Region::from).collect(),
            },
            CopySide {
                layout: self.host_layout.clone(),
                regions: vec![Region::from(self.host.clone())],
            },
            self.device
                .copy_stream_with(Direction::DeviceToHost, limits.copy)?,
            self.device
                .copy_stream_with(Direction::HostToDevice, limits.copy)?,
            limits,
            metrics,
        );
        let copies = match copies {
            Ok(c) => Arc::new(c),
            Err(e) => {
                self.loaders = Some(self.restart_loaders(self.copies.clone(), done, threads)?);
                return Err(e);
            }
        };
        self.copies.wait_idle();
        self.copies = copies.clone();
        self.loaders = Some(self.restart_loaders(copies, done, threads)?);
        self.gpu = gpu_layout;
        self.suspended = false;
        Ok(())
    }

    fn restart_loaders(
        &self,
        copies: Arc<CopyEngine>,
        done: Vec<(String, Vec<u32>)>,
        threads: usize,
    ) -> Result<Loaders, CoreError> {
        start_loaders(
            Arc::new(LoaderContext {
                copies,
                host: self.host.clone(),
                host_stride: self.kv.host_stride_bytes(),
                ready_timeout: self.ready_timeout,
                disk: self.disk.as_ref().map(|d| d.shared.clone()),
                shared: self.shared.as_ref().map(|s| s.side.clone()),
                bad: self.bad.clone(),
                metrics: self.metrics.clone(),
                done: Mutex::new(done),
                busy: Mutex::new(0),
                busy_cv: Condvar::new(),
            }),
            threads.max(1),
        )
    }

    /// Waits for everything in flight: offloads, onboards, asynchronous onboards, disk writes.
    pub fn shutdown(&mut self) {
        self.wait_offloads();
        let _ = self.wait_onboards();
        self.wait_async();
        self.wait_disk();
    }

    // -- the mechanisms -------------------------------------------------------------------

    /// Starts offloading GPU blocks into host blocks (`(gpu, host)` pairs) on behalf of
    /// `requests` (each counts it as one of its pending offloads).
    /// Each request is then reported in `finished_offloading` once vLLM says it finished and
    /// none of its offloads is in flight.
    pub fn offload(&mut self, pairs: &[(u32, u32)], requests: &[String]) -> Result<(), CoreError> {
        self.offload_with(pairs, requests, None).map(drop)
    }

    /// As [`Self::offload`], calling `on_batch` with each finished batch (its pairs among
    /// `pairs`); returns the job's ticket, or None when nothing was copied.
    pub fn offload_with(
        &mut self,
        pairs: &[(u32, u32)],
        requests: &[String],
        on_batch: Option<OnBatch>,
    ) -> Result<Option<CopyTicket>, CoreError> {
        self.offloaded.extend(requests.iter().cloned());
        self.check_pairs(pairs.iter().map(|&(g, h)| (h, g)))?;
        // A GPU block whose onboard failed in this step holds no valid bytes: it is not
        // offloaded, and its host block is marked bad so that no later onboard serves it.
        let failed: HashSet<u32> = self.failed.iter().copied().collect();
        let (unloaded, pairs): (Pairs, Pairs) = pairs.iter().partition(|(g, _)| failed.contains(g));
        {
            let mut bad = self.bad.lock();
            for &(_, h) in &unloaded {
                bad.offload_failed(h);
            }
        }
        if pairs.is_empty() {
            for r in requests {
                if !self.offload_pending.contains_key(r) {
                    self.offload_done.push(r.clone());
                }
            }
            return Ok(None);
        }
        self.wait_blocks_ready(pairs.iter().map(|&(_, h)| h))?;
        if let Some(disk) = &self.disk {
            // A disk write still reading one of these host blocks finishes first.
            for &(_, h) in &pairs {
                disk.shared.wait_for_writes(Some(h), None);
            }
        }
        if let Some(shared) = &self.shared {
            // So does a shared write still to copy one out.
            for &(_, h) in &pairs {
                shared.side.wait_for_writes(h);
            }
        }
        let ticket = self.copies.submit(
            CopyJob {
                direction: Direction::DeviceToHost,
                pairs: pairs.clone(),
                stage: None,
            },
            on_batch,
            true,
        )?;
        for r in requests {
            *self.offload_pending.entry(r.clone()).or_insert(0) += 1;
        }
        {
            let mut bad = self.bad.lock();
            for &(_, h) in &pairs {
                bad.host.remove(&h);
            }
        }
        self.offloads.push(PendingOffload {
            ticket: ticket.clone(),
            host_blocks: pairs.iter().map(|&(_, h)| h).collect(),
            pairs,
            requests: requests.to_vec(),
        });
        Ok(Some(ticket))
    }

    /// Waits for the offloads started on behalf of any of `requests`; returns how many offload
    /// jobs it waited for.
    pub fn wait_offloads_of(&mut self, requests: &[String]) -> usize {
        let wanted: HashSet<&str> = requests.iter().map(String::as_str).collect();
        self.wait_offloads_where(|o| o.requests.iter().any(|r| wanted.contains(r.as_str())))
    }

    /// Waits for the offloads writing any of `hosts` (one stream keeps earlier offloads first,
    /// so a later offload into the same block is never overtaken).
    pub fn wait_offloads_touching(&mut self, hosts: &HashSet<u32>) -> usize {
        self.wait_offloads_where(|o| !o.host_blocks.is_disjoint(hosts))
    }

    /// Waits for every offload started so far.
    pub fn wait_offloads(&mut self) {
        let offloads = std::mem::take(&mut self.offloads);
        for o in offloads {
            let outcome = o.ticket.wait();
            self.settle(o, &outcome);
        }
    }

    /// Requests whose offloads have all completed since the last call (without waiting).
    pub fn poll_offloads(&mut self) -> Vec<String> {
        let (done, still): (Vec<PendingOffload>, Vec<PendingOffload>) =
            std::mem::take(&mut self.offloads)
                .into_iter()
                .partition(|o| o.ticket.is_done());
        self.offloads = still;
        for o in done {
            let outcome = o.ticket.wait();
            self.settle(o, &outcome);
        }
        std::mem::take(&mut self.offload_done)
    }

    /// Starts onboarding host blocks into GPU blocks (`(host, gpu)` pairs), one job per onboard
    /// stage (per layer, or per group of layers whose runs are merged), after the offloads into
    /// those host blocks completed. Pairs whose host block is bad are reported as failed.
    pub fn onboard(&mut self, pairs: &[(u32, u32)]) -> Result<(), CoreError> {
        self.check_pairs(pairs.iter().copied())?;
        let hosts: HashSet<u32> = pairs.iter().map(|&(h, _)| h).collect();
        self.wait_offloads_touching(&hosts);
        self.wait_onboards()?;
        let (bad, good): (Pairs, Pairs) = {
            let bad = self.bad.lock();
            pairs.iter().partition(|(h, _)| bad.host.contains(h))
        };
        self.failed.extend(bad.iter().map(|&(_, g)| g));
        if good.is_empty() {
            return Ok(());
        }
        self.wait_blocks_ready(good.iter().map(|&(h, _)| h))?;
        let gpu_blocks: Vec<u32> = good.iter().map(|&(_, g)| g).collect();
        for &stage in &self.stages {
            let submitted = self.copies.submit(
                CopyJob {
                    direction: Direction::HostToDevice,
                    pairs: good.clone(),
                    stage: Some(stage),
                },
                None,
                true,
            );
            match submitted {
                Ok(ticket) => {
                    self.onboards[stage as usize] = Some(PendingOnboard {
                        ticket,
                        gpu_blocks: gpu_blocks.clone(),
                    })
                }
                Err(err) => {
                    tracing::warn!(error = %err, "onboard not submitted");
                    self.failed.extend(gpu_blocks.iter().copied());
                }
            }
        }
        add(&self.metrics.onboard_blocks_h2d, good.len() as u64);
        Ok(())
    }

    /// Starts onboarding host blocks into GPU blocks (`(host, gpu)` pairs) whole, as one job
    /// (not per stage: for a caller that waits for the job, not for layers), after the offloads
    /// into those host blocks completed, calling `on_batch` with each finished batch (its pairs
    /// among `pairs`). Returns the job's ticket (None when nothing was copied) and the GPU
    /// blocks refused because their host block is bad (never copied).
    pub fn onboard_with(
        &mut self,
        pairs: &[(u32, u32)],
        on_batch: Option<OnBatch>,
    ) -> Result<(Option<CopyTicket>, Vec<u32>), CoreError> {
        self.check_pairs(pairs.iter().copied())?;
        let hosts: HashSet<u32> = pairs.iter().map(|&(h, _)| h).collect();
        self.wait_offloads_touching(&hosts);
        let (bad, good): (Pairs, Pairs) = {
            let bad = self.bad.lock();
            pairs.iter().partition(|(h, _)| bad.host.contains(h))
        };
        let refused: Vec<u32> = bad.iter().map(|&(_, g)| g).collect();
        if good.is_empty() {
            return Ok((None, refused));
        }
        self.wait_blocks_ready(good.iter().map(|&(h, _)| h))?;
        let n = good.len();
        let ticket = self.copies.submit(
            CopyJob {
                direction: Direction::HostToDevice,
                pairs: good,
                stage: None,
            },
            on_batch,
            true,
        )?;
        add(&self.metrics.onboard_blocks_h2d, n as u64);
        Ok((Some(ticket), refused))
    }

    /// Waits until tensor `layer`'s onboards are in place (its stage and the stages before it on
    /// the same stream); false if any failed (their blocks go to [`Self::take_failed`]).
    pub fn wait_layer(&mut self, layer: usize) -> Result<bool, CoreError> {
        let Some(&stage) = self.ready_after.get(layer) else {
            return Err(CoreError::InvalidArgument(format!(
                "layer {layer} of {}",
                self.ready_after.len()
            )));
        };
        let mut ok = true;
        for slot in &mut self.onboards[..=stage as usize] {
            let Some(load) = slot.take() else {
                continue;
            };
            let outcome = load.ticket.wait();
            self.bytes_onboarded += outcome.bytes;
            if !outcome.is_ok() {
                // A stage's batches are cut in the same order as its pairs.
                for r in &outcome.failed {
                    self.failed
                        .extend(load.gpu_blocks[r.clone()].iter().copied());
                }
                ok = false;
            }
        }
        Ok(ok)
    }

    /// Waits for every stage's onboards; false if any failed.
    pub fn wait_onboards(&mut self) -> Result<bool, CoreError> {
        match self.ready_after.len() {
            0 => Ok(true),
            n => self.wait_layer(n - 1),
        }
    }

    /// GPU blocks whose onboards failed since the last call, sorted, without repeats.
    pub fn take_failed(&mut self) -> Vec<u32> {
        let mut f = std::mem::take(&mut self.failed);
        f.sort_unstable();
        f.dedup();
        add(&self.metrics.load_errors, f.len() as u64);
        f
    }

    /// Marks host blocks bad whose offload the caller could not start (their leader drops them
    /// itself): no onboard or disk write reads them until an offload fills them again.
    pub fn offload_refused(&mut self, hosts: &[u32]) {
        self.bad.lock().host.extend(hosts.iter().copied());
    }

    /// Fails the next `n` copy batches of `direction` (emulated device only; for tests of the
    /// failure paths).
    pub fn fail_next_copies(&self, direction: Direction, n: usize) -> Result<(), CoreError> {
        Ok(self.copies.stream(direction).fail_next(n)?)
    }

    /// Blocks that went bad since the last call (or report), for the leader to drop: host
    /// blocks whose offload failed, disk blocks whose write failed or whose read failed
    /// verification.
    pub fn take_bad(&mut self) -> (Vec<u32>, Vec<u32>) {
        let mut bad = self.bad.lock();
        (
            std::mem::take(&mut bad.reported_host),
            std::mem::take(&mut bad.reported_disk),
        )
    }

    /// Queues disk writes of host blocks; the writer makes each after the offloads into its host
    /// block completed (and skips it, reporting the disk block bad, if that offload failed).
    /// Waits (at most [`DISK_WRITES_QUEUED_MAX`] queue) when the writer is behind.
    pub fn disk_write(&mut self, writes: Vec<DiskWrite>) -> Result<(), CoreError> {
        if writes.is_empty() {
            return Ok(());
        }
        let Some(disk) = &self.disk else {
            return Err(CoreError::InvalidArgument(
                "disk writes for a worker without a disk tier".into(),
            ));
        };
        let (hosts, slots) = (self.host_blocks(), disk.shared.store.slots());
        if let Some(w) = writes
            .iter()
            .find(|w| w.host as usize >= hosts || w.disk as usize >= slots)
        {
            return Err(CoreError::InvalidArgument(format!(
                "host block {} / disk block {} outside {hosts} host / {slots} disk blocks",
                w.host, w.disk
            )));
        }
        // The writer waits for the offloads into these host blocks (not this thread: the step
        // goes on while the copies run).
        let touched: HashSet<u32> = writes.iter().map(|w| w.host).collect();
        let after: Vec<(CopyTicket, Pairs)> = self
            .offloads
            .iter()
            .filter(|o| !o.host_blocks.is_disjoint(&touched))
            .map(|o| (o.ticket.clone(), o.pairs.clone()))
            .collect();
        let disk = self.disk.as_ref().expect("checked above");
        {
            let mut p = disk.shared.pending.lock();
            for w in &writes {
                p.add(w.host, w.disk);
            }
        }
        let jobs = disk.jobs.as_ref().expect("open while the worker lives");
        for chunk in writes.chunks(64) {
            let job = WriteJob {
                writes: chunk.to_vec(),
                after: after.clone(),
            };
            if jobs.send(job).is_err() {
                // The writer is gone: the leader registered these disk blocks, so they are
                // reported bad.
                disk.shared
                    .bad
                    .lock()
                    .reported_disk
                    .extend(chunk.iter().map(|w| w.disk));
                let mut p = disk.shared.pending.lock();
                for w in chunk {
                    p.done(w.host, w.disk);
                }
                disk.shared.pending_cv.notify_all();
            }
        }
        Ok(())
    }

    /// Queues shared-tier writes of host blocks; the shared writer copies each out after the
    /// offloads into its host block completed (skipping those that failed: nothing is written
    /// then) and hands the copies to the store. Waits (at most [`SHARED_WRITES_QUEUED_MAX`]
    /// queued) when the writer is behind. Writes to a worker without a shared tier are refused.
    pub fn shared_write(&mut self, writes: Vec<SharedWrite>) -> Result<(), CoreError> {
        if writes.is_empty() {
            return Ok(());
        }
        let hosts = self.host_blocks();
        let Some(shared) = &self.shared else {
            return Err(CoreError::InvalidArgument(
                "shared writes for a worker without a shared tier".into(),
            ));
        };
        if let Some(w) = writes.iter().find(|w| w.host as usize >= hosts) {
            return Err(CoreError::InvalidArgument(format!(
                "shared write of host block {} outside {hosts} host blocks",
                w.host
            )));
        }
        let touched: HashSet<u32> = writes.iter().map(|w| w.host).collect();
        let after: Vec<(CopyTicket, Pairs)> = self
            .offloads
            .iter()
            .filter(|o| !o.host_blocks.is_disjoint(&touched))
            .map(|o| (o.ticket.clone(), o.pairs.clone()))
            .collect();
        {
            let mut p = shared.side.pending.lock();
            for w in &writes {
                *p.entry(w.host).or_insert(0) += 1;
            }
        }
        let jobs = shared.jobs.as_ref().expect("open while the worker lives");
        for chunk in writes.chunks(64) {
            let job = SharedJob {
                writes: chunk.to_vec(),
                after: after.clone(),
            };
            if jobs.send(job).is_err() {
                for w in chunk {
                    shared.side.done(w.host);
                }
            }
        }
        Ok(())
    }

    /// Waits until the shared writer copied out every queued write and, up to `limit`, until
    /// the store sent them; false when some were still in flight then (or there is no shared
    /// tier).
    pub fn wait_shared(&self, limit: Duration) -> bool {
        let Some(shared) = &self.shared else {
            return false;
        };
        {
            let mut p = shared.side.pending.lock();
            while !p.is_empty() {
                shared.side.pending_cv.wait(&mut p);
            }
        }
        shared.side.store.flush(limit)
    }

    /// The shared tier's counters, if the worker has one.
    pub fn shared_counts(&self) -> Option<SharedCounts> {
        self.shared.as_ref().map(|s| s.side.store.counts())
    }

    /// Reads disk blocks into host blocks now (after the queued writes of those slots and the
    /// offloads into those host blocks); returns the host blocks that missed, which later
    /// onboards report as failed instead of copying.
    pub fn disk_read(&mut self, reads: &[DiskRead]) -> Result<Vec<u32>, CoreError> {
        if reads.is_empty() {
            return Ok(Vec::new());
        }
        let Some(disk) = &self.disk else {
            return Err(CoreError::InvalidArgument(
                "disk reads for a worker without a disk tier".into(),
            ));
        };
        let (hosts, slots) = (self.host_blocks(), disk.shared.store.slots());
        if let Some(r) = reads
            .iter()
            .find(|r| r.host as usize >= hosts || r.disk as usize >= slots)
        {
            return Err(CoreError::InvalidArgument(format!(
                "disk block {} / host block {} outside {slots} disk / {hosts} host blocks",
                r.disk, r.host
            )));
        }
        let touched: HashSet<u32> = reads.iter().map(|r| r.host).collect();
        self.wait_offloads_touching(&touched);
        self.wait_blocks_ready(reads.iter().map(|r| r.host))?;
        if let Some(shared) = &self.shared {
            for &h in &touched {
                shared.side.wait_for_writes(h);
            }
        }
        let disk = self.disk.as_ref().expect("checked above");
        Ok(disk.shared.read_into_host(reads))
    }

    /// Queues an asynchronous onboard (disk reads into staging host blocks, then host blocks
    /// into GPU blocks) after the offloads into any of its host blocks completed; several run
    /// at once. [`Self::poll_async`] reports it when done.
    pub fn onboard_async(&mut self, job: AsyncOnboard) -> Result<(), CoreError> {
        self.check_pairs(job.pairs.iter().copied())?;
        let slots = self.disk_blocks();
        if let Some(r) = job.disk_reads.iter().find(|r| {
            (self.disk.is_some() && r.disk as usize >= slots)
                || r.host as usize >= self.host_blocks()
        }) {
            return Err(CoreError::InvalidArgument(format!(
                "disk block {} / host block {} outside {slots} disk / {} host blocks",
                r.disk,
                r.host,
                self.host_blocks()
            )));
        }
        if let Some(r) = job
            .shared_reads
            .iter()
            .find(|r| r.host as usize >= self.host_blocks())
        {
            return Err(CoreError::InvalidArgument(format!(
                "shared read into host block {} outside {} host blocks",
                r.host,
                self.host_blocks()
            )));
        }
        let hosts: HashSet<u32> = job
            .disk_reads
            .iter()
            .map(|r| r.host)
            .chain(job.shared_reads.iter().map(|r| r.host))
            .chain(job.pairs.iter().map(|&(h, _)| h))
            .collect();
        self.wait_offloads_touching(&hosts);
        if let Some(shared) = &self.shared {
            // A disk read of this job into a host block a shared write still has to copy out
            // waits for it (the loader waits before shared reads itself).
            for r in &job.disk_reads {
                shared.side.wait_for_writes(r.host);
            }
        }
        let loaders = self.loaders.as_ref().expect("present until dropped");
        *loaders.context.busy.lock() += 1;
        let sent = loaders
            .jobs
            .as_ref()
            .expect("open while the worker lives")
            .send(job);
        if sent.is_err() {
            *loaders.context.busy.lock() -= 1;
            return Err(CoreError::EngineClosed);
        }
        Ok(())
    }

    /// Waits until every asynchronous onboard queued so far finished.
    pub fn wait_async(&self) {
        let context = &self
            .loaders
            .as_ref()
            .expect("present until dropped")
            .context;
        let mut n = context.busy.lock();
        while *n > 0 {
            context.busy_cv.wait(&mut n);
        }
    }

    /// Asynchronous onboards finished since the last call: (request, GPU blocks that failed).
    pub fn poll_async(&mut self) -> Vec<(String, Vec<u32>)> {
        let context = &self
            .loaders
            .as_ref()
            .expect("present until dropped")
            .context;
        std::mem::take(&mut *context.done.lock())
    }

    /// Waits until every queued disk write finished.
    pub fn wait_disk(&self) {
        if let Some(disk) = &self.disk {
            let mut p = disk.shared.pending.lock();
            while !p.by_slot.is_empty() {
                disk.shared.pending_cv.wait(&mut p);
            }
        }
    }

    /// Waits up to `timeout` until the whole host pool is pinned; returns whether it is.
    pub fn wait_host_ready(&self, timeout: Duration) -> bool {
        self.host.wait_ready(self.host.len(), timeout)
    }

    /// Keeps the stream of `direction` from starting further copies until the returned hold
    /// drops (emulated device only; for tests that need a copy in flight).
    pub fn hold_stream(&self, direction: Direction) -> Result<kvbm_cuda::StreamHold, CoreError> {
        Ok(self.copies.stream(direction).hold()?)
    }

    // -- internals ------------------------------------------------------------------------

    /// Checks `(host, gpu)` pairs against the pools' sizes.
    fn check_pairs(&self, pairs: impl Iterator<Item = (u32, u32)>) -> Result<(), CoreError> {
        if self.suspended {
            return Err(CoreError::InvalidArgument(
                "the KV caches are unregistered (vLLM's sleep mode): no copy touches GPU memory \
                 until they are restored"
                    .into(),
            ));
        }
        let (nh, ng) = (self.host_blocks(), self.gpu.num_blocks());
        for (h, g) in pairs {
            if h as usize >= nh || g as usize >= ng {
                return Err(CoreError::InvalidArgument(format!(
                    "host block {h} / GPU block {g} outside {nh} host / {ng} GPU blocks"
                )));
            }
        }
        Ok(())
    }

    fn wait_offloads_where(&mut self, pick: impl Fn(&PendingOffload) -> bool) -> usize {
        let (chosen, rest): (Vec<PendingOffload>, Vec<PendingOffload>) =
            std::mem::take(&mut self.offloads)
                .into_iter()
                .partition(pick);
        self.offloads = rest;
        if chosen.is_empty() {
            return 0;
        }
        let n = chosen.len();
        for o in chosen {
            let outcome = o.ticket.wait();
            self.settle(o, &outcome);
        }
        self.offload_waits += 1;
        n
    }

    /// Waits until the host blocks' memory is pinned.
    fn wait_blocks_ready(&self, blocks: impl Iterator<Item = u32>) -> Result<(), CoreError> {
        let Some(last) = blocks.max() else {
            return Ok(());
        };
        let end = (last as usize + 1) * self.kv.host_stride_bytes();
        if self.host.ready_bytes() >= end || self.host.wait_ready(end, self.ready_timeout) {
            return Ok(());
        }
        Err(CoreError::TransferFailed(format!(
            "host memory not pinned after {:?} ({} of {end} bytes ready)",
            self.ready_timeout,
            self.host.ready_bytes()
        )))
    }

    fn settle(&mut self, offload: PendingOffload, outcome: &crate::copy::CopyOutcome) {
        self.bytes_offloaded += outcome.bytes;
        let failed_blocks: usize = outcome.failed.iter().map(|r| r.len()).sum();
        add(
            &self.metrics.offload_blocks_d2h,
            (offload.pairs.len() - failed_blocks) as u64,
        );
        if !outcome.failed.is_empty() {
            let mut bad = self.bad.lock();
            for r in &outcome.failed {
                for &(_, h) in &offload.pairs[r.clone()] {
                    bad.offload_failed(h);
                }
            }
        }
        for r in offload.requests {
            if let Some(n) = self.offload_pending.get_mut(&r) {
                *n -= 1;
                if *n == 0 {
                    self.offload_pending.remove(&r);
                    self.offload_done.push(r);
                }
            }
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Loaders first (they copy), then the writer (it reads the host pool), then the copies.
        self.loaders.take();
        self.disk.take();
        self.shared.take();
        self.copies.wait_idle();
    }
}

/// Opens this rank's cache file (what it held is kept for [`Worker::take_recovered_disk`]; a
/// leader that does not adopt it overwrites it) and starts its writer; the host pool gets registered for fixed-buffer I/O once pinned.
fn open_disk(
    options: &DiskOptions,
    kv: KvLayout,
    geometry_id: u64,
    host_layout: &BlockLayout,
    host: &HostRegion,
    metrics: &Arc<Metrics>,
    bad: &SharedBad,
) -> Result<DiskSide, CoreError> {
    let (store, recovered) = DiskStore::open(
        &options.dir,
        &options.file_name,
        store_options(options, kv, geometry_id),
    )
    .map_err(|e| {
        CoreError::Disk(format!(
            "disk cache {}: {e}",
            options.dir.join(&options.file_name).display()
        ))
    })?;
    let shared = Arc::new(DiskShared {
        store,
        host_layout: host_layout.clone(),
        host_region: host.clone(),
        pending: Mutex::new(DiskPending::default()),
        pending_cv: Condvar::new(),
        metrics: metrics.clone(),
        registered: Mutex::new(None),
        registered_cv: Condvar::new(),
        bad: bad.clone(),
    });
    let region = shared.host_region.clone();
    handoff::register_in_background(Arc::downgrade(&shared), region, "kvbm-worker-disk-register")
        .map_err(|e| CoreError::Disk(format!("cannot start the disk registration: {e}")))?;
    let (jobs, receiver) = crossbeam_channel::bounded::<WriteJob>(DISK_WRITES_QUEUED_MAX / 64);
    let writer = shared.clone();
    let thread = crate::disk::spawn_writer("kvbm-worker-disk", receiver, move |job| {
        writer.write_job(job)
    })?;
    Ok(DiskSide {
        shared,
        recovered: recovered
            .blocks
            .into_iter()
            .map(|b| (b.slot, b.key, b.metadata))
            .collect(),
        jobs: Some(jobs),
        thread: Some(thread),
    })
}

impl handoff::PinnedPool for DiskShared {
    fn parts(&self) -> (&DiskStore, &BlockLayout, &HostRegion) {
        (&self.store, &self.host_layout, &self.host_region)
    }

    fn registered(&self, ok: bool) {
        *self.registered.lock() = Some(ok);
        self.registered_cv.notify_all();
    }
}

/// Opens this rank's shared tier (connecting lazily: a server down now is an outage of the
/// tier, not an error) and starts its writer.
#[allow(clippy::too_many_arguments)] // the worker's parts the shared side keeps
fn open_shared(
    options: &SharedWorkerOptions,
    kv: KvLayout,
    geometry_id: u64,
    host_layout: &BlockLayout,
    host: &HostRegion,
    ready_timeout: Duration,
    metrics: &Arc<Metrics>,
    bad: &SharedBad,
) -> Result<SharedTier, CoreError> {
    let store = SharedStore::open(
        options.options.clone(),
        options.key_fingerprint,
        kv.bytes_per_block(),
    )?
    .with_layout(crate::disk::layout_fingerprint(&kv, geometry_id));
    let side = Arc::new(SharedSide {
        store,
        host_layout: host_layout.clone(),
        host_region: host.clone(),
        host_stride: kv.host_stride_bytes(),
        ready_timeout,
        payload_bytes: kv.bytes_per_block(),
        pending: Mutex::new(HashMap::new()),
        pending_cv: Condvar::new(),
        metrics: metrics.clone(),
        bad: bad.clone(),
    });
    let (jobs, receiver) = crossbeam_channel::bounded::<SharedJob>(SHARED_WRITES_QUEUED_MAX / 64);
    let writer = side.clone();
    let thread = crate::disk::spawn_writer("kvbm-worker-shared", receiver, move |job| {
        writer.write_job(job)
    })?;
    Ok(SharedTier {
        side,
        jobs: Some(jobs),
        thread: Some(thread),
    })
}

fn start_loaders(context: Arc<LoaderContext>, threads: usize) -> Result<Loaders, CoreError> {
    let (jobs, receiver) = crossbeam_channel::bounded::<AsyncOnboard>(ASYNC_ONBOARDS_QUEUED_MAX);
    let mut handles = Vec::with_capacity(threads);
    for i in 0..threads {
        let receiver = receiver.clone();
        let context = context.clone();
        let handle = std::thread::Builder::new()
            .name(format!("kvbm-onboard-{i}"))
            .spawn(move || {
                for job in receiver {
                    let failed = context.run(&job);
                    context.done.lock().push((job.request, failed));
                    let mut busy = context.busy.lock();
                    *busy -= 1;
                    context.busy_cv.notify_all();
                }
            })
            .map_err(|e| CoreError::InvalidArgument(format!("cannot start a loader: {e}")))?;
        handles.push(handle);
    }
    Ok(Loaders {
        context,
        jobs: Some(jobs),
        threads: handles,
    })
}

/// Reads from a GPU or host region.
fn read_region(
    region: &Region,
    offset: usize,
    out: &mut [u8],
) -> Result<(), kvbm_cuda::DeviceError> {
    match region {
        Region::Gpu(g) => g.read(offset, out),
        Region::Host(h) => h.read(offset, out),
    }
}

/// Runs `io` on each run of block `id` of `side` (`len` must be one block): the region holding
/// the run, the offset in it, and the run's range in canonical order.
fn block_io(
    kv: KvLayout,
    side: &CopySide,
    id: u32,
    len: usize,
    mut io: impl FnMut(&Region, usize, std::ops::Range<usize>) -> Result<(), kvbm_cuda::DeviceError>,
) -> Result<(), CoreError> {
    let index = id as usize;
    if len != kv.bytes_per_block() || index >= side.layout.num_blocks() {
        return Err(CoreError::InvalidArgument(format!(
            "block {id} of {} with {len} bytes; blocks are {} bytes",
            side.layout.num_blocks(),
            kv.bytes_per_block()
        )));
    }
    let mut result = Ok(());
    side.layout.for_each_run(index, |addr, offset, len, _| {
        if result.is_err() {
            return;
        }
        let region = side
            .regions
            .iter()
            .find(|r| r.addr() <= addr && addr + len as u64 <= r.addr() + r.len() as u64);
        result = match region {
            None => Err(CoreError::InvalidLayout(format!(
                "run at {addr:#x} outside every region"
            ))),
            Some(region) => io(
                region,
                (addr - region.addr()) as usize,
                offset..offset + len,
            )
            .map_err(CoreError::from),
        };
    });
    result
}
