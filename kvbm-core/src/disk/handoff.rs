//! The one `unsafe` room of kvbm-core: handing the memory of held host blocks to kvbm-disk.
//!
//! Why it is sound: a block's address comes from the host tier's layout, so it lies inside the
//! host region (a fully contiguous layout, 4 KiB-aligned strides, the store's payload area equal
//! to the stride). The region is moved into the I/O's keep-alive, so it outlives the I/O. And the
//! block states keep everyone else off those bytes: a write's source is an `ImmutableBlock`
//! (registered, never written, never evicted while held), and a read's target is a
//! `MutableBlock` (owned by this read alone). Both calls wait for their I/O before returning.
#![allow(unsafe_code)]

use kvbm_cuda::HostRegion;
use kvbm_disk::{DiskError, DiskStore, Lookup, WriteOutcome, WriteRequest};

use crate::layout::BlockLayout;
use crate::pool::{ImmutableBlock, MutableBlock};

/// Writes held host blocks into disk slots: `(host block, disk slot, metadata)`.
pub(crate) fn write_host_blocks(
    store: &DiskStore,
    host_layout: &BlockLayout,
    host_region: &HostRegion,
    items: &[(&ImmutableBlock, u32, Vec<u8>)],
) -> Result<Vec<WriteOutcome>, DiskError> {
    debug_assert!(store.payload_area_bytes() <= host_layout.kv().contiguous_stride_bytes());
    let requests: Vec<WriteRequest> = items
        .iter()
        .map(|(block, slot, metadata)| WriteRequest {
            slot: *slot,
            key: block.sequence_hash().0,
            addr: host_layout.chunk_addr(block.id().index(), 0, 0),
            metadata,
        })
        .collect();
    // SAFETY: see the module header: the sources are held registered blocks inside the host
    // region, which moves into the keep-alive; `write_raw` waits for the I/O.
    unsafe { store.write_raw(&requests, Box::new(host_region.clone())) }
}

/// Reads disk slots into host blocks being filled: `(disk slot, key, host target)`.
pub(crate) fn read_into_host_blocks(
    store: &DiskStore,
    host_layout: &BlockLayout,
    host_region: &HostRegion,
    items: &[(u32, u64, &MutableBlock)],
) -> Result<Vec<Lookup>, DiskError> {
    debug_assert!(store.payload_area_bytes() <= host_layout.kv().contiguous_stride_bytes());
    let reads: Vec<(u32, u64, u64)> = items
        .iter()
        .map(|(slot, key, target)| {
            (
                *slot,
                *key,
                host_layout.chunk_addr(target.id().index(), 0, 0),
            )
        })
        .collect();
    // SAFETY: see the module header: the targets are host blocks owned by this read alone,
    // inside the host region, which moves into the keep-alive; `read_raw` waits for the I/O.
    unsafe { store.read_raw(&reads, Box::new(host_region.clone())) }
}
