//! The one `unsafe` room of kvbm-core: handing the memory of held host blocks to kvbm-disk.
//!
//! Why it is sound: a block's address comes from the host tier's layout, so it lies inside the
//! host region, behind [`HEADER_ROOM_BYTES`] of header room that belongs to that block alone
//! (a fully contiguous layout, 4 KiB-aligned strides, the store's payload area no larger than the
//! block's). The region is moved into each I/O's keep-alive, so it outlives the I/O, and the disk
//! tier keeps a clone for as long as the store (and its registration of the region) lives. The
//! block states keep everyone else off those bytes: a write's source is an `ImmutableBlock`
//! (registered, never written, never evicted while held; its header room is written only by the
//! one disk write of that hash at a time), and a read's target is a `MutableBlock` (owned by this
//! read alone). Both calls wait for their I/O before returning.
#![allow(unsafe_code)]

use kvbm_cuda::HostRegion;
use kvbm_disk::{
    DiskError, DiskStore, Lookup, ReadRequest, WriteOutcome, WriteRequest,
    REGISTERED_BUFFER_BYTES_MAX,
};

use crate::layout::{BlockLayout, HEADER_ROOM_BYTES};
use crate::pool::{ImmutableBlock, MutableBlock};

fn check(store: &DiskStore, host_layout: &BlockLayout) {
    debug_assert!(
        store.payload_area_bytes() + HEADER_ROOM_BYTES
            <= host_layout.block_stride_bytes().unwrap_or(0)
    );
}

/// Writes held host blocks into disk slots: `(host block, disk slot, metadata)`.
pub(crate) fn write_host_blocks(
    store: &DiskStore,
    host_layout: &BlockLayout,
    host_region: &HostRegion,
    items: &[(&ImmutableBlock, u32, Vec<u8>)],
) -> Result<Vec<WriteOutcome>, DiskError> {
    check(store, host_layout);
    let requests: Vec<WriteRequest> = items
        .iter()
        .map(|(block, slot, metadata)| WriteRequest {
            slot: *slot,
            key: block.sequence_hash().0,
            addr: host_layout.block_start(block.id().index()),
            metadata,
            framed: true,
        })
        .collect();
    // SAFETY: see the module header: the sources are held registered blocks inside the host
    // region, each behind its own header room; the region moves into the keep-alive;
    // `write_raw` waits for the I/O.
    unsafe { store.write_raw(&requests, Box::new(host_region.clone())) }
}

/// Reads disk slots into host blocks being filled: `(disk slot, key, host target)`.
pub(crate) fn read_into_host_blocks(
    store: &DiskStore,
    host_layout: &BlockLayout,
    host_region: &HostRegion,
    items: &[(u32, u64, &MutableBlock)],
) -> Result<Vec<Lookup>, DiskError> {
    check(store, host_layout);
    let reads: Vec<ReadRequest> = items
        .iter()
        .map(|(slot, key, target)| ReadRequest {
            slot: *slot,
            key: *key,
            addr: host_layout.block_start(target.id().index()),
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
