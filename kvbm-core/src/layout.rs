//! KV layouts: how one block's bytes are spread over memory, and the copy pieces between layouts.
//!
//! A block holds, for every layer and every outer index (K and V, or one for MLA), one *chunk* of
//! `block_size_tokens * inner_dim * dtype_bytes` bytes. Layouts differ only in where each chunk
//! lives:
//! - `LayerSeparate` (GPU, vLLM's per-layer tensors): one tensor per layer, either
//!   `[outer, n_blocks, block, inner]` ([`LayerShape::OuterFirst`]) or
//!   `[n_blocks, outer, block, inner]` ([`LayerShape::BlockFirst`]);
//! - `FullyContiguous` (host, disk): block `b` is one contiguous run of chunks ordered
//!   (layer, outer), starting at `base + b * block_stride_bytes`.
//!
//! Invariant: two layouts copy between each other only when their [`KvLayout`]s are equal; the
//! pieces visit chunks in (layer, outer) order and merge chunks that continue each other on both
//! sides, so a contiguous-to-contiguous copy is one piece per block.

use kvbm_cuda::CopyPiece;

use crate::CoreError;

/// Alignment of a contiguous block's start (O_DIRECT and page pinning want 4 KiB).
pub const BLOCK_ALIGN_BYTES: usize = 4096;
/// Room kept before each host block for its disk header, so that a block and its header move
/// to and from disk as one contiguous op from registered memory.
pub const HEADER_ROOM_BYTES: usize = 4096;

/// The shape of one worker's KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayout {
    /// Attention layers.
    pub num_layers: usize,
    /// 2 for separate K and V, 1 for MLA's joint latent.
    pub outer_dim: usize,
    /// Tokens per block.
    pub block_size_tokens: usize,
    /// Elements per token per layer per outer index (KV heads x head size).
    pub inner_dim: usize,
    /// Bytes per element (2 for bf16/fp16, 1 for fp8).
    pub dtype_bytes: usize,
}

impl KvLayout {
    /// Checks that every dimension is positive, the outer dim is 1 or 2, and the block size fits.
    pub fn new(
        num_layers: usize,
        outer_dim: usize,
        block_size_tokens: usize,
        inner_dim: usize,
        dtype_bytes: usize,
    ) -> Result<Self, CoreError> {
        let layout = Self {
            num_layers,
            outer_dim,
            block_size_tokens,
            inner_dim,
            dtype_bytes,
        };
        let zero = [num_layers, block_size_tokens, inner_dim, dtype_bytes].contains(&0);
        let bytes = num_layers
            .checked_mul(outer_dim)
            .and_then(|n| n.checked_mul(block_size_tokens))
            .and_then(|n| n.checked_mul(inner_dim))
            .and_then(|n| n.checked_mul(dtype_bytes));
        if zero || !(1..=2).contains(&outer_dim) || bytes.is_none_or(|b| b > u32::MAX as usize) {
            return Err(CoreError::InvalidLayout(format!("{layout:?}")));
        }
        Ok(layout)
    }

    /// Bytes of one (layer, outer) slice of one block.
    pub fn chunk_bytes(&self) -> usize {
        self.block_size_tokens * self.inner_dim * self.dtype_bytes
    }

    /// Chunks per block (layers x outer).
    pub fn chunks_per_block(&self) -> usize {
        self.num_layers * self.outer_dim
    }

    /// Bytes of one block.
    pub fn bytes_per_block(&self) -> usize {
        self.chunk_bytes() * self.chunks_per_block()
    }

    /// Stride between blocks in a fully contiguous layout: the block size rounded up to
    /// [`BLOCK_ALIGN_BYTES`].
    pub fn contiguous_stride_bytes(&self) -> usize {
        self.bytes_per_block().div_ceil(BLOCK_ALIGN_BYTES) * BLOCK_ALIGN_BYTES
    }

    /// Stride between host blocks: [`Self::contiguous_stride_bytes`] plus the header room.
    pub fn host_stride_bytes(&self) -> usize {
        self.contiguous_stride_bytes() + HEADER_ROOM_BYTES
    }

    /// Bytes of one layer's tensor holding `num_blocks` blocks in a layer-separate layout.
    pub fn layer_bytes(&self, num_blocks: usize) -> usize {
        self.outer_dim * num_blocks * self.chunk_bytes()
    }
}

/// The two per-layer tensor shapes vLLM uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerShape {
    /// `[outer, n_blocks, block, inner]` (vLLM's FlashAttention layout `[2, num_blocks, ...]`).
    OuterFirst,
    /// `[n_blocks, outer, block, inner]` (vLLM's FlashInfer layout `[num_blocks, 2, ...]`).
    BlockFirst,
}

/// Where a region's blocks live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayoutKind {
    /// One tensor per layer, at `layer_bases[l]`.
    LayerSeparate {
        /// The tensors' shape.
        shape: LayerShape,
        /// Address of each layer's tensor.
        layer_bases: Vec<u64>,
    },
    /// One contiguous run per block.
    FullyContiguous {
        /// Address of the first block's stride.
        base: u64,
        /// Bytes from one block's stride to the next (at least `lead_bytes + bytes_per_block`).
        block_stride_bytes: usize,
        /// Bytes at the start of each stride before the block's data (header room, or 0).
        lead_bytes: usize,
    },
}

/// A KV layout placed in memory: `num_blocks` blocks at known addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockLayout {
    kv: KvLayout,
    num_blocks: usize,
    kind: LayoutKind,
}

impl BlockLayout {
    /// vLLM's per-layer tensors: one base address per layer.
    pub fn layer_separate(
        kv: KvLayout,
        num_blocks: usize,
        shape: LayerShape,
        layer_bases: Vec<u64>,
    ) -> Result<Self, CoreError> {
        if layer_bases.len() != kv.num_layers {
            return Err(CoreError::InvalidLayout(format!(
                "{} layer tensors for {} layers",
                layer_bases.len(),
                kv.num_layers
            )));
        }
        Ok(Self {
            kv,
            num_blocks,
            kind: LayoutKind::LayerSeparate { shape, layer_bases },
        })
    }

    /// Fully contiguous blocks from `base`, each `kv.contiguous_stride_bytes()` apart.
    pub fn fully_contiguous(kv: KvLayout, num_blocks: usize, base: u64) -> Self {
        Self {
            kv,
            num_blocks,
            kind: LayoutKind::FullyContiguous {
                base,
                block_stride_bytes: kv.contiguous_stride_bytes(),
                lead_bytes: 0,
            },
        }
    }

    /// The host tier's layout: fully contiguous blocks, each behind [`HEADER_ROOM_BYTES`] of
    /// header room, `kv.host_stride_bytes()` apart.
    pub fn host(kv: KvLayout, num_blocks: usize, base: u64) -> Self {
        Self {
            kv,
            num_blocks,
            kind: LayoutKind::FullyContiguous {
                base,
                block_stride_bytes: kv.host_stride_bytes(),
                lead_bytes: HEADER_ROOM_BYTES,
            },
        }
    }

    /// Bytes from one block to the next in a fully contiguous layout.
    pub fn block_stride_bytes(&self) -> Option<usize> {
        match &self.kind {
            LayoutKind::FullyContiguous {
                block_stride_bytes, ..
            } => Some(*block_stride_bytes),
            LayoutKind::LayerSeparate { .. } => None,
        }
    }

    /// The KV shape.
    pub fn kv(&self) -> &KvLayout {
        &self.kv
    }

    /// Blocks in this placement.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Where the blocks live.
    pub fn kind(&self) -> &LayoutKind {
        &self.kind
    }

    /// Address of chunk (layer, outer) of `block`.
    #[inline]
    pub fn chunk_addr(&self, block: usize, layer: usize, outer: usize) -> u64 {
        debug_assert!(
            block < self.num_blocks && layer < self.kv.num_layers && outer < self.kv.outer_dim
        );
        let chunk = self.kv.chunk_bytes() as u64;
        match &self.kind {
            LayoutKind::LayerSeparate { shape, layer_bases } => {
                let index = match shape {
                    LayerShape::OuterFirst => outer * self.num_blocks + block,
                    LayerShape::BlockFirst => block * self.kv.outer_dim + outer,
                };
                layer_bases[layer] + index as u64 * chunk
            }
            LayoutKind::FullyContiguous {
                base,
                block_stride_bytes,
                lead_bytes,
            } => {
                let within = (layer * self.kv.outer_dim + outer) as u64 * chunk;
                base + (block * block_stride_bytes + lead_bytes) as u64 + within
            }
        }
    }

    /// Appends the pieces copying block `src_block` of `self` into block `dst_block` of `dst`.
    pub fn copy_pieces_into(
        &self,
        src_block: usize,
        dst: &BlockLayout,
        dst_block: usize,
        out: &mut Vec<CopyPiece>,
    ) -> Result<(), CoreError> {
        if self.kv != dst.kv {
            return Err(CoreError::InvalidLayout(format!(
                "copy between different KV layouts {:?} and {:?}",
                self.kv, dst.kv
            )));
        }
        if src_block >= self.num_blocks || dst_block >= dst.num_blocks {
            return Err(CoreError::InvalidLayout(format!(
                "block {src_block} -> {dst_block} outside {} / {} blocks",
                self.num_blocks, dst.num_blocks
            )));
        }
        let chunk = self.kv.chunk_bytes();
        let first = out.len();
        for layer in 0..self.kv.num_layers {
            for outer in 0..self.kv.outer_dim {
                let src = self.chunk_addr(src_block, layer, outer);
                let dst_addr = dst.chunk_addr(dst_block, layer, outer);
                if out.len() > first {
                    let last = out.last_mut().expect("not empty");
                    if last.src + last.len as u64 == src && last.dst + last.len as u64 == dst_addr {
                        last.len += chunk;
                        continue;
                    }
                }
                out.push(CopyPiece {
                    src,
                    dst: dst_addr,
                    len: chunk,
                });
            }
        }
        Ok(())
    }
}
