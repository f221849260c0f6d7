//! The one `unsafe` room of kvbm-core's disk tier: handing the memory of host blocks to kvbm-disk
//! (zero-copy: io_uring reads and writes the pinned host pool in place, with registered buffers
//! once the pool is registered).
//!
//! One caller: the worker (block ids from a leader's plan; [`write_host_ids`],
//! [`read_host_ids`]), whether it serves the vLLM connector or the block manager.
//!
//! Why it is sound: a block's address comes from the host tier's layout, so it lies inside the
//! host region, behind [`HEADER_ROOM_BYTES`] of header room that belongs to that block alone
//! (a fully contiguous layout, 4 KiB-aligned strides, the store's payload area no larger than the
//! block's). The region is moved into each I/O's keep-alive, so it outlives the I/O, and the
//! worker keeps a clone for as long as the store (and its registration of the region) lives. The
//! worker's ordering rules (see `crate::worker`) keep everyone else off those bytes: a host block
//! is never written by a copy or a disk read while a disk write reads it (or writes its header
//! room), nor read while a disk read writes it. Every id is checked against the host layout and
//! the store before any address is formed. All calls wait for their I/O before returning.
#![allow(unsafe_code)]

use kvbm_cuda::HostRegion;
use kvbm_disk::{
    DiskError, DiskStore, Lookup, ReadRequest, WriteOutcome, WriteRequest,
    REGISTERED_BUFFER_BYTES_MAX,
};

use crate::layout::{BlockLayout, HEADER_ROOM_BYTES};

/// A store and a host layout fit when every block's payload area and its header room fit in the
/// host stride; nothing is read or written otherwise.
fn check(store: &DiskStore, host_layout: &BlockLayout) -> Result<(), DiskError> {
    let stride = host_layout.block_stride_bytes().unwrap_or(0);
    if store.payload_area_bytes() + HEADER_ROOM_BYTES > stride {
        return Err(DiskError::Invalid(format!(
            "a store of {} payload bytes a block does not fit host blocks of {stride} bytes",
            store.payload_area_bytes()
        )));
    }
    Ok(())
}

/// Refuses a host block named twice in one call: two I/Os into (or from the header room of) one
/// block at once would race.
fn check_distinct(hosts: impl Iterator<Item = u32>) -> Result<(), DiskError> {
    let mut seen = std::collections::HashSet::new();
    for h in hosts {
        if !seen.insert(h) {
            return Err(DiskError::Invalid(format!(
                "host block {h} named twice in one disk call"
            )));
        }
    }
    Ok(())
}

/// A disk write of host block `host` into disk slot `slot`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HostWrite<'a> {
    pub host: u32,
    pub slot: u32,
    pub key: u64,
    pub metadata: &'a [u8],
}

/// Checks a host block id and a slot against the host layout and the store.
fn check_ids(
    store: &DiskStore,
    host_layout: &BlockLayout,
    host: u32,
    slot: u32,
) -> Result<(), DiskError> {
    if host as usize >= host_layout.num_blocks() || slot as usize >= store.slots() {
        return Err(DiskError::Invalid(format!(
            "host block {host} / disk block {slot} outside {} host / {} disk blocks",
            host_layout.num_blocks(),
            store.slots()
        )));
    }
    Ok(())
}

/// Writes host blocks into disk slots, by id (the caller keeps copies off them meanwhile; see
/// the module header): one outcome per item. A call refused as a whole (an id outside the pools,
/// a host block named twice, a store that does not fit) fails every item, logged once.
pub(crate) fn write_host_ids(
    store: &DiskStore,
    host_layout: &BlockLayout,
    host_region: &HostRegion,
    items: &[HostWrite<'_>],
) -> Vec<WriteOutcome> {
    try_write_host_ids(store, host_layout, host_region, items).unwrap_or_else(|err| {
        tracing::warn!(error = %err, blocks = items.len(), "disk write refused");
        vec![WriteOutcome::Failed(err.to_string()); items.len()]
    })
}

/// [`write_host_ids`], with a refusal of the whole call as an error.
fn try_write_host_ids(
    store: &DiskStore,
    host_layout: &BlockLayout,
    host_region: &HostRegion,
    items: &[HostWrite<'_>],
) -> Result<Vec<WriteOutcome>, DiskError> {
    check(store, host_layout)?;
    check_distinct(items.iter().map(|w| w.host))?;
    for w in items {
        check_ids(store, host_layout, w.host, w.slot)?;
    }
    let requests: Vec<WriteRequest> = items
        .iter()
        .map(|w| WriteRequest {
            slot: w.slot,
            key: w.key,
            addr: host_layout.block_start(w.host as usize),
            metadata: w.metadata,
            framed: true,
        })
        .collect();
    // SAFETY: see the module header: the sources are held registered blocks inside the host
    // region, each behind its own header room; the region moves into the keep-alive;
    // `write_raw` waits for the I/O.
    unsafe { store.write_raw(&requests, Box::new(host_region.clone())) }
}

/// Reads disk slots into host blocks, by id: `(disk slot, key, host block)` (the caller keeps
/// every other copy off those host blocks meanwhile; see the module header). An id outside the
/// pools refuses the whole call.
pub(crate) fn read_host_ids(
    store: &DiskStore,
    host_layout: &BlockLayout,
    host_region: &HostRegion,
    items: &[(u32, u64, u32)],
) -> Result<Vec<Lookup>, DiskError> {
    check(store, host_layout)?;
    check_distinct(items.iter().map(|&(_, _, h)| h))?;
    for &(slot, _, host) in items {
        check_ids(store, host_layout, host, slot)?;
    }
    let reads: Vec<ReadRequest> = items
        .iter()
        .map(|&(slot, key, host)| ReadRequest {
            slot,
            key,
            addr: host_layout.block_start(host as usize),
            framed: true,
        })
        .collect();
    // SAFETY: see the module header: the targets (and their header rooms) are host blocks owned
    // by this read alone, inside the host region, which moves into the keep-alive; `read_raw`
    // waits for the I/O.
    unsafe { store.read_raw(&reads, Box::new(host_region.clone())) }
}

/// Registers the host region with the store's engine in pieces of at most 1 GiB, cut at block
/// boundaries, so that every block (with its header room) moves with fixed-buffer ops.
pub(crate) fn register_host_region(
    store: &DiskStore,
    host_layout: &BlockLayout,
    host_region: &HostRegion,
) -> Result<(), DiskError> {
    let stride = host_layout
        .block_stride_bytes()
        .expect("a host tier is fully contiguous");
    let piece = (REGISTERED_BUFFER_BYTES_MAX / stride).max(1) * stride;
    let len = host_region.len();
    let pieces: Vec<(u64, usize)> = (0..len)
        .step_by(piece)
        .map(|at| {
            (
                host_region.addr() + at as u64,
                piece.min(len - at).min(REGISTERED_BUFFER_BYTES_MAX),
            )
        })
        .collect();
    // SAFETY: the disk tier holds a clone of the region for as long as the store lives (its
    // shared state declares the store first, so the store and its engine drop before the region).
    unsafe { store.register_buffers(&pieces) }
}

/// The owner of a disk store and the host region it moves blocks in and out of.
pub(crate) trait PinnedPool: Send + Sync + 'static {
    /// The store, the host layout and the host region.
    fn parts(&self) -> (&DiskStore, &BlockLayout, &HostRegion);
    /// Told once whether the region got registered.
    fn registered(&self, ok: bool);
}

/// Registers the owner's host region with its store once the region is fully pinned, on a
/// background thread that does not keep the owner alive while it waits (so that dropping the
/// owner closes its store, and releases its file lock, at once): the first I/Os go without
/// fixed buffers rather than wait for the whole pool.
pub(crate) fn register_in_background<T: PinnedPool>(
    weak: std::sync::Weak<T>,
    region: HostRegion,
    name: &str,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || loop {
            if weak.strong_count() == 0 {
                return;
            }
            if region.wait_ready(region.len(), std::time::Duration::from_millis(100)) {
                let Some(owner) = weak.upgrade() else { return };
                let (store, layout, region) = owner.parts();
                let ok = match register_host_region(store, layout, region) {
                    Ok(()) => {
                        tracing::info!(
                            bytes = region.len(),
                            "host pool registered for fixed-buffer disk I/O"
                        );
                        true
                    }
                    Err(err) => {
                        tracing::warn!(error = %err, "could not register the host pool for disk I/O; going on without");
                        false
                    }
                };
                owner.registered(ok);
                return;
            }
        })
        .map(|_| ())
}
