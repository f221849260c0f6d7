//! KV layouts: how one block's bytes are spread over memory, and the copy pieces between layouts.
//!
//! A block holds, for every layer, the KV of `block_size_tokens` tokens. Two kinds of placement:
//! - **Paged** (GPU): the engine's tensors. A block's bytes are a fixed list of runs (address
//!   of block 0, length) that moves by `block_stride_bytes` from one block to the next. The runs
//!   are derived from each tensor's shape and strides ([`BlockLayout::from_views`]): vLLM 0.33's
//!   `[B, H, N, C]` per-layer views of one backing buffer in any [`PhysicalLayout`], the older
//!   `[2, B, N, H, D]` / `[B, 2, N, H, D]` per-layer tensors ([`LayerShape`]) and MLA's
//!   `[B, N, D]`. The order of the runs is the block's *canonical order*: tensors whose pages
//!   interleave or overlap (views of one buffer, overlaid cache groups) contribute the union of
//!   their bytes in memory order, and such clusters follow each other in registration order. So
//!   a block-outermost layout (BLNHC, BLHNC, BHLNC) is one run per block, LBNHC/LBHNC one run
//!   per layer, LHBNC one per (layer, head), and separate tensors keep their layer order.
//! - **FullyContiguous** (host, disk): block `b` is one run of the block's bytes in canonical
//!   order, starting at `base + b * block_stride_bytes + lead_bytes`.
//!
//! Invariants:
//! - Two layouts copy between each other only when their [`KvLayout`]s are equal; pieces follow
//!   the canonical order and merge runs that continue each other on both sides, so paged to
//!   contiguous is one piece per run of the paged side.
//! - A paged layout's runs never overlap each other: a tensor whose strides make two elements
//!   share bytes is refused, and bytes that several tensors address (vLLM's overlaid cache
//!   groups, layers sharing a cache) are one run, copied once.
//! - The canonical order is part of [`BlockLayout::geometry_id`], which the disk tier stores, so a
//!   block written under one GPU layout is never read back as data under another.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use kvbm_cuda::CopyPiece;

use crate::CoreError;

/// Alignment of a contiguous block's start (O_DIRECT and page pinning want 4 KiB).
pub const BLOCK_ALIGN_BYTES: usize = 4096;
/// Room kept before each host block for its disk header, so that a block and its header move
/// to and from disk as one contiguous op from registered memory.
pub const HEADER_ROOM_BYTES: usize = 4096;
/// Runs per block at most in a paged layout (an unaddressable layout is refused rather than
/// copied a few bytes at a time).
pub const RUNS_PER_BLOCK_MAX: usize = 1 << 16;

/// The shape of one worker's KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayout {
    /// Attention layers.
    pub num_layers: usize,
    /// 2 for separate K and V, 1 for MLA's joint latent (and for vLLM 0.33's views, whose
    /// content axis holds K and V side by side).
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

    /// Bytes of one layer's page of one block.
    pub fn page_bytes(&self) -> usize {
        self.chunk_bytes() * self.outer_dim
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

/// The per-layer tensor shapes of vLLM releases before 0.33 (one allocation per layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerShape {
    /// `[outer, n_blocks, block, inner]` (vLLM's FlashAttention layout `[2, num_blocks, ...]`).
    OuterFirst,
    /// `[n_blocks, outer, block, inner]` (vLLM's FlashInfer layout `[num_blocks, 2, ...]`).
    BlockFirst,
}

/// How a block manager lays out the GPU memory it allocates (or is given).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GpuLayout {
    /// One tensor per layer, in a shape of vLLM releases before 0.33.
    LayerSeparate(LayerShape),
    /// vLLM 0.33: one backing buffer for every layer, viewed per layer in `layout`, with
    /// `num_heads` KV heads (the content axis is K and V side by side).
    Paged {
        /// The physical order of the axes.
        layout: PhysicalLayout,
        /// KV heads per layer on this rank.
        num_heads: usize,
    },
}

impl From<LayerShape> for GpuLayout {
    fn from(shape: LayerShape) -> Self {
        Self::LayerSeparate(shape)
    }
}

impl GpuLayout {
    /// Bytes of each GPU allocation holding `num_blocks` blocks of `kv`: one per layer, or one.
    pub fn allocation_bytes(&self, kv: &KvLayout, num_blocks: usize) -> Vec<usize> {
        match self {
            Self::LayerSeparate(_) => vec![kv.layer_bytes(num_blocks); kv.num_layers],
            Self::Paged { .. } => vec![kv.layer_bytes(num_blocks) * kv.num_layers],
        }
    }

    /// The placement of `num_blocks` blocks of `kv` in allocations at `addrs` (as many as
    /// [`Self::allocation_bytes`] lists).
    pub fn place(
        &self,
        kv: KvLayout,
        num_blocks: usize,
        addrs: &[u64],
    ) -> Result<BlockLayout, CoreError> {
        match *self {
            Self::LayerSeparate(shape) => {
                BlockLayout::layer_separate(kv, num_blocks, shape, addrs.to_vec())
            }
            Self::Paged { layout, num_heads } => {
                let [base] = addrs else {
                    return Err(CoreError::InvalidLayout(format!(
                        "{} allocations for a {layout} KV cache: it lives in one",
                        addrs.len()
                    )));
                };
                let shape = PagedShape::of(&kv, num_heads)?;
                let views = layout.views(&shape, num_blocks, *base);
                BlockLayout::from_views(&views, num_blocks)?
                    .layout
                    .with_kv(kv)
            }
        }
    }

    /// A short name: vLLM's layout name, or the older shape's.
    pub fn name(&self) -> String {
        match self {
            Self::LayerSeparate(LayerShape::OuterFirst) => "outer-first".into(),
            Self::LayerSeparate(LayerShape::BlockFirst) => "block-first".into(),
            Self::Paged { layout, .. } => layout.name().to_ascii_lowercase(),
        }
    }
}

/// vLLM 0.33's physical KV cache layouts (`vllm/v1/kv_cache_layout.py`, `KVCacheLayout`): the
/// order in memory, outermost first, of the logical axes L (layers), B (blocks), H (KV heads),
/// N (tokens in a block) and C (content: K and V side by side, or MLA's latent).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PhysicalLayout {
    /// vLLM's default preference (legacy "NHD").
    Lbnhc,
    /// Legacy "HND".
    Lbhnc,
    /// Head-major within a layer: a block's page of one layer is H runs.
    Lhbnc,
    /// Block-outermost, heads before tokens.
    Blhnc,
    /// Block-outermost, tokens before heads (what kvbm's connector asks vLLM for).
    Blnhc,
    /// Block-outermost, heads before layers.
    Bhlnc,
}

/// The logical axes of a paged KV cache, as indices into `[L, B, H, N, C]`.
const AXIS_L: usize = 0;
const AXIS_B: usize = 1;

impl PhysicalLayout {
    /// Every layout, in vLLM's default order of preference.
    pub const ALL: [Self; 6] = [
        Self::Lbnhc,
        Self::Lbhnc,
        Self::Blnhc,
        Self::Blhnc,
        Self::Bhlnc,
        Self::Lhbnc,
    ];

    /// vLLM's name of the layout.
    pub fn name(self) -> &'static str {
        match self {
            Self::Lbnhc => "LBNHC",
            Self::Lbhnc => "LBHNC",
            Self::Lhbnc => "LHBNC",
            Self::Blhnc => "BLHNC",
            Self::Blnhc => "BLNHC",
            Self::Bhlnc => "BHLNC",
        }
    }

    /// The logical axes (0 = L, 1 = B, 2 = H, 3 = N, 4 = C) from outermost to innermost in
    /// memory (vLLM's `stride_order`).
    pub fn stride_order(self) -> [usize; 5] {
        match self {
            Self::Lbhnc => [0, 1, 2, 3, 4],
            Self::Lbnhc => [0, 1, 3, 2, 4],
            Self::Lhbnc => [0, 2, 1, 3, 4],
            Self::Blhnc => [1, 0, 2, 3, 4],
            Self::Blnhc => [1, 0, 3, 2, 4],
            Self::Bhlnc => [1, 2, 0, 3, 4],
        }
    }

    /// B is the outermost axis: one block of every layer is one contiguous run.
    pub fn is_block_outermost(self) -> bool {
        self.stride_order()[0] == AXIS_B
    }

    /// L and B are the two outermost axes: each layer's page of a block is one run.
    pub fn is_block_compact(self) -> bool {
        let order = self.stride_order();
        (order[0] == AXIS_L && order[1] == AXIS_B) || (order[0] == AXIS_B && order[1] == AXIS_L)
    }

    /// The per-layer `[B, H, N, C]` views of a backing buffer at `base` holding `num_blocks`
    /// blocks of `shape`, laid out as vLLM 0.33 lays them out (`compute_layout_strides` and
    /// `create_kv_cache_views` in `vllm/v1/kv_cache_interface.py`, without page padding).
    pub fn views(self, shape: &PagedShape, num_blocks: usize, base: u64) -> Vec<TensorView> {
        let sizes = [
            shape.num_layers,
            num_blocks,
            shape.num_heads,
            shape.block_size_tokens,
            shape.content_elems,
        ];
        let mut strides = [0usize; 5];
        let mut current = 1usize;
        for &axis in self.stride_order().iter().rev() {
            strides[axis] = current;
            current *= sizes[axis];
        }
        (0..shape.num_layers)
            .map(|l| TensorView {
                name: format!("layer.{l}"),
                addr: base + (l * strides[AXIS_L] * shape.elem_bytes) as u64,
                shape: sizes[1..].to_vec(),
                strides: strides[1..].to_vec(),
                elem_bytes: shape.elem_bytes,
            })
            .collect()
    }

    /// Bytes of the backing buffer [`Self::views`] addresses.
    pub fn buffer_bytes(shape: &PagedShape, num_blocks: usize) -> usize {
        shape.num_layers * num_blocks * shape.page_bytes()
    }
}

impl fmt::Display for PhysicalLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PhysicalLayout {
    type Err = CoreError;

    /// vLLM's names, any case; `NHD` and `HND` are vLLM's aliases of LBNHC and LBHNC.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let upper = s.trim().to_ascii_uppercase();
        match upper.as_str() {
            "NHD" => return Ok(Self::Lbnhc),
            "HND" => return Ok(Self::Lbhnc),
            _ => {}
        }
        Self::ALL
            .into_iter()
            .find(|l| l.name() == upper)
            .ok_or_else(|| {
                CoreError::InvalidLayout(format!(
                    "unknown KV cache layout {s:?}: expected one of LBNHC, LBHNC, LHBNC, BLHNC, \
                     BLNHC, BHLNC (or NHD, HND)"
                ))
            })
    }
}

/// The logical shape of a vLLM 0.33 paged KV cache on one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedShape {
    /// Layers (L).
    pub num_layers: usize,
    /// KV heads (H); 1 for MLA.
    pub num_heads: usize,
    /// Tokens per block (N).
    pub block_size_tokens: usize,
    /// Elements of content per token and head (C): 2 x head size, or MLA's latent size.
    pub content_elems: usize,
    /// Bytes per element.
    pub elem_bytes: usize,
}

impl PagedShape {
    /// The shape of `kv` with `num_heads` heads (the content is K and V side by side).
    pub fn of(kv: &KvLayout, num_heads: usize) -> Result<Self, CoreError> {
        if num_heads == 0 || kv.inner_dim % num_heads != 0 {
            return Err(CoreError::InvalidLayout(format!(
                "{num_heads} heads do not divide the inner dimension {}",
                kv.inner_dim
            )));
        }
        Ok(Self {
            num_layers: kv.num_layers,
            num_heads,
            block_size_tokens: kv.block_size_tokens,
            content_elems: kv.outer_dim * kv.inner_dim / num_heads,
            elem_bytes: kv.dtype_bytes,
        })
    }

    /// Bytes of one layer's page of one block.
    pub fn page_bytes(&self) -> usize {
        self.num_heads * self.block_size_tokens * self.content_elems * self.elem_bytes
    }
}

/// One tensor as the engine hands it: its first element's address, shape and strides (in
/// elements, as torch's `stride()`), and element size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorView {
    /// The engine's name for it (the layer name), for error messages.
    pub name: String,
    /// Address of element [0, 0, ...].
    pub addr: u64,
    /// Sizes per axis.
    pub shape: Vec<usize>,
    /// Strides per axis, in elements.
    pub strides: Vec<usize>,
    /// Bytes per element.
    pub elem_bytes: usize,
}

impl TensorView {
    /// The address range (start, bytes) of every element the view addresses, or None when an
    /// axis is empty or the range overflows.
    pub fn span(&self) -> Option<(u64, usize)> {
        if self.shape.len() != self.strides.len() || self.shape.contains(&0) || self.elem_bytes == 0
        {
            return None;
        }
        let mut last = 0usize; // offset of the last element, in elements
        for (&size, &stride) in self.shape.iter().zip(&self.strides) {
            last = last.checked_add((size - 1).checked_mul(stride)?)?;
        }
        let bytes = last.checked_add(1)?.checked_mul(self.elem_bytes)?;
        self.addr.checked_add(bytes as u64)?;
        Some((self.addr, bytes))
    }
}

/// Where a region's blocks live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayoutKind {
    /// The engine's tensors: block `b`'s runs are `runs` moved by `b * block_stride_bytes`.
    Paged {
        /// Block 0's runs in canonical order.
        runs: Vec<Run>,
        /// Bytes from one block's runs to the next block's.
        block_stride_bytes: u64,
        /// Identifies the canonical order (see [`BlockLayout::geometry_id`]).
        geometry_id: u64,
        /// Per tensor the layout was built from (the runs' layer tags index them), the last tag
        /// of the runs holding its bytes (see [`BlockLayout::ready_after`]).
        ready: Vec<u32>,
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

/// One contiguous run of a paged block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Run {
    /// Address in block 0.
    pub addr: u64,
    /// Bytes.
    pub len: usize,
    /// Bytes of the block (in canonical order) before this run.
    pub offset: usize,
    /// The first and last tensor (in registration order: a layer, or an overlaid layer) whose
    /// bytes the run holds.
    pub layers: (u32, u32),
}

/// A KV layout placed in memory: `num_blocks` blocks at known addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockLayout {
    kv: KvLayout,
    num_blocks: usize,
    kind: LayoutKind,
}

/// A paged layout derived from the engine's tensors ([`BlockLayout::from_views`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ViewsLayout {
    /// The KV shape the tensors hold (layers: their distinct pages).
    pub kv: KvLayout,
    /// Where each block's bytes are.
    pub layout: BlockLayout,
    /// The vLLM 0.33 layout the strides match, when they match one.
    pub physical: Option<PhysicalLayout>,
    /// Address ranges (start, bytes) the tensors address, merged where they touch: the memory to
    /// register with the device.
    pub spans: Vec<(u64, usize)>,
}

/// One axis of a page: `size` steps of `stride` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Axis {
    size: usize,
    stride: usize,
}

/// One tensor's geometry in bytes: block 0 at `addr`, blocks `block_stride` apart, and the
/// axes of a page (the last one contiguous: stride 1, size = the innermost run's bytes).
#[derive(Debug, Clone)]
struct Page {
    addr: u64,
    block_stride: usize,
    axes: Vec<Axis>,
}

impl Page {
    /// The page's runs relative to `addr`, ascending: the axes sorted by stride, the inner ones
    /// that continue each other merged into one run.
    fn runs(&self) -> Vec<(usize, usize)> {
        let mut axes: Vec<Axis> = self.axes.iter().copied().filter(|a| a.size > 1).collect();
        axes.sort_by_key(|a| std::cmp::Reverse(a.stride));
        let mut run = 1usize;
        while let Some(inner) = axes.last() {
            if inner.stride != run {
                break;
            }
            run *= inner.size;
            axes.pop();
        }
        let mut out = vec![(0usize, run)];
        for axis in axes.iter().rev() {
            let inner = std::mem::take(&mut out);
            for i in 0..axis.size {
                out.extend(inner.iter().map(|&(o, l)| (o + i * axis.stride, l)));
            }
        }
        out.sort_unstable();
        out
    }

    fn page_bytes(&self) -> usize {
        self.axes.iter().map(|a| a.size).product()
    }

    /// The highest byte any block's page reaches, plus one, relative to `addr`.
    fn extent(&self, num_blocks: usize) -> usize {
        (num_blocks - 1) * self.block_stride
            + self
                .axes
                .iter()
                .map(|a| (a.size - 1) * a.stride)
                .sum::<usize>()
            + 1
    }

    /// No two elements of any two blocks share a byte: with the axes (and the block axis)
    /// sorted by stride, each stride clears everything inside it.
    fn is_injective(&self, num_blocks: usize) -> bool {
        let mut axes: Vec<Axis> = self.axes.iter().copied().filter(|a| a.size > 1).collect();
        if num_blocks > 1 {
            axes.push(Axis {
                size: num_blocks,
                stride: self.block_stride,
            });
        }
        axes.sort_by_key(|a| a.stride);
        let mut reach = 0usize; // bytes spanned by the axes inside, minus one
        for (i, a) in axes.iter().enumerate() {
            let needed = if i == 0 { 1 } else { reach + 1 };
            if a.stride < needed {
                return false;
            }
            reach += (a.size - 1) * a.stride;
        }
        true
    }
}

const SUPPORTED: &str = "kvbm addresses vLLM 0.33's [B, H, N, C] per-layer views in every \
    KVCacheLayout (LBNHC, LBHNC, LHBNC, BLHNC, BLNHC, BHLNC), MLA's [B, 1, N, C] and [B, N, C], \
    and the older [2, B, N, H, D] / [B, 2, N, H, D] tensors, with the last axis contiguous";

impl BlockLayout {
    /// vLLM's per-layer tensors of releases before 0.33: one base address per layer.
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
        let chunk = kv.chunk_bytes();
        let (outer_stride, block_stride) = match shape {
            LayerShape::OuterFirst => (num_blocks * chunk, chunk),
            LayerShape::BlockFirst => (chunk, kv.outer_dim * chunk),
        };
        let pages: Vec<Page> = layer_bases
            .iter()
            .map(|&addr| Page {
                addr,
                block_stride,
                axes: vec![
                    Axis {
                        size: kv.outer_dim,
                        stride: outer_stride,
                    },
                    Axis {
                        size: chunk,
                        stride: 1,
                    },
                ],
            })
            .collect();
        let tag = format!("layer-separate {shape:?}");
        Self::paged(kv, num_blocks, &pages, &tag)
    }

    /// The engine's tensors, one per layer (`views`), each holding `num_blocks` blocks: the piece
    /// list of a block is derived from their shapes and strides. A tensor whose block axis is a
    /// multiple of `num_blocks` holds vLLM's kernel blocks, that many per block. Tensors that
    /// address the same bytes (vLLM's overlaid cache groups, shared layers) have them copied
    /// once. The runs' layer tags are indices into `views`.
    ///
    /// Refused, with the tensor's name, shape and strides: a last axis that is not contiguous,
    /// strides under which two elements share bytes, tensors of different block strides or
    /// element sizes.
    pub fn from_views(views: &[TensorView], num_blocks: usize) -> Result<ViewsLayout, CoreError> {
        if views.is_empty() || num_blocks == 0 {
            return Err(CoreError::InvalidLayout(format!(
                "{} KV cache tensors of {num_blocks} blocks: need at least one of each",
                views.len()
            )));
        }
        let refuse = |v: &TensorView, why: &str| {
            CoreError::InvalidLayout(format!(
                "KV cache tensor {:?} of shape {:?} and strides {:?} ({} bytes per element): \
                 {why}. {SUPPORTED}",
                v.name, v.shape, v.strides, v.elem_bytes
            ))
        };
        let mut pages = Vec::with_capacity(views.len());
        let mut shapes = Vec::with_capacity(views.len());
        for v in views {
            let (page, kv) = Self::page_of(v, num_blocks).map_err(|why| refuse(v, &why))?;
            if let Some(first) = pages.first().map(|p: &Page| p.block_stride) {
                if page.block_stride != first {
                    return Err(refuse(
                        v,
                        &format!(
                            "its blocks are {} bytes apart where the first tensor's are {first}",
                            page.block_stride
                        ),
                    ));
                }
            }
            pages.push(page);
            shapes.push(kv);
        }
        // Views of one buffer may differ in element size: vLLM 0.33 views a hybrid model's
        // Mamba / linear-attention state as 1-byte `[B, 1, 1, state bytes]` pages inside the
        // attention pages of the same slots (`create_kv_cache_views` in
        // `vllm/v1/kv_cache_interface.py`; the state page is padded to the attention page by
        // `Platform._align_hybrid_block_size`). Bytes are bytes: a block is the union of every
        // view's runs, whatever their element type. Its KV shape is described by the view with
        // the largest page (the attention layers'; the most tokens among equals).
        let reference = (0..shapes.len())
            .max_by_key(|&i| {
                (
                    shapes[i].bytes_per_block(),
                    shapes[i].block_size_tokens,
                    std::cmp::Reverse(i),
                )
            })
            .expect("at least one view");
        let physical = detect_physical(views, &pages);
        let tag = format!("views {:?}", physical.map(PhysicalLayout::name));
        let layout = Self::paged(shapes[reference], num_blocks, &pages, &tag)?;
        // Several groups over one buffer (hybrid models): the layout is the one the reference
        // view's kind follows over its distinct slots (the name only; the id keeps the tag).
        let physical = physical.or_else(|| {
            let r = &views[reference];
            let mut seen = std::collections::HashSet::new();
            let (kind, kind_pages): (Vec<TensorView>, Vec<Page>) = views
                .iter()
                .zip(&pages)
                .filter(|(v, _)| {
                    v.shape == r.shape && v.strides == r.strides && v.elem_bytes == r.elem_bytes
                })
                .filter(|(v, _)| seen.insert(v.addr))
                .map(|(v, p)| (v.clone(), p.clone()))
                .unzip();
            let mut order: Vec<usize> = (0..kind.len()).collect();
            order.sort_by_key(|&i| kind[i].addr);
            let kind: Vec<TensorView> = order.iter().map(|&i| kind[i].clone()).collect();
            let kind_pages: Vec<Page> = order.iter().map(|&i| kind_pages[i].clone()).collect();
            detect_physical(&kind, &kind_pages)
        });
        let kv = *layout.kv();
        let mut spans: Vec<(u64, u64)> = pages
            .iter()
            .map(|p| (p.addr, p.addr + p.extent(num_blocks) as u64))
            .collect();
        spans.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(spans.len());
        for (s, e) in spans {
            match merged.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => merged.push((s, e)),
            }
        }
        Ok(ViewsLayout {
            kv,
            layout,
            physical,
            spans: merged
                .into_iter()
                .map(|(s, e)| (s, (e - s) as usize))
                .collect(),
        })
    }

    /// One tensor's page geometry and the KV shape it holds, or why it cannot be addressed.
    fn page_of(v: &TensorView, num_blocks: usize) -> Result<(Page, KvLayout), String> {
        let rank = v.shape.len();
        if v.strides.len() != rank || !(3..=5).contains(&rank) {
            return Err(format!("{rank} axes (and {} strides)", v.strides.len()));
        }
        if v.elem_bytes == 0 || v.shape.contains(&0) {
            return Err("an empty axis or element".into());
        }
        if v.strides[rank - 1] != 1 && v.shape[rank - 1] > 1 {
            return Err("the last axis is not contiguous".into());
        }
        // The block axis, the K/V axis if any, and the token axis.
        let (block_axis, outer_axis, token_axis) = match rank {
            3 => (0, None, 1), // [B, N, D]
            4 => (0, None, 2), // [B, H, N, C]
            _ if v.shape[0] == 2 && v.shape[1] % num_blocks == 0 => (1, Some(0), 2), // [2, B, ...]
            _ if v.shape[1] == 2 => (0, Some(1), 2), // [B, 2, ...]
            _ if v.shape[0] == 2 => (1, Some(0), 2), // [2, B, ...]
            _ => return Err("no K/V axis of size 2 next to a block axis".into()),
        };
        let blocks = v.shape[block_axis];
        if blocks % num_blocks != 0 {
            return Err(format!(
                "its {blocks} blocks are not a multiple of the engine's {num_blocks}"
            ));
        }
        let ratio = blocks / num_blocks;
        let e = v.elem_bytes;
        let mut axes = Vec::with_capacity(rank + 1);
        for axis in 0..rank {
            if axis == block_axis {
                continue;
            }
            if axis == rank - 1 {
                axes.push(Axis {
                    size: v.shape[axis] * e,
                    stride: 1,
                });
            } else {
                axes.push(Axis {
                    size: v.shape[axis],
                    stride: v.strides[axis] * e,
                });
            }
        }
        let kernel_stride = v.strides[block_axis] * e;
        if ratio > 1 {
            // Kernel blocks: `ratio` consecutive ones make one of the engine's blocks.
            axes.push(Axis {
                size: ratio,
                stride: kernel_stride,
            });
        }
        let page = Page {
            addr: v.addr,
            block_stride: kernel_stride * ratio,
            axes,
        };
        if !page.is_injective(num_blocks) {
            return Err("its strides make different elements share bytes".into());
        }
        let runs = page.runs().len();
        if runs > RUNS_PER_BLOCK_MAX {
            return Err(format!(
                "a block's page is {runs} runs (at most {RUNS_PER_BLOCK_MAX})"
            ));
        }
        let outer = outer_axis.map_or(1, |a| v.shape[a]);
        let tokens = v.shape[token_axis] * ratio;
        let page_elems = page.page_bytes() / e;
        let kv = KvLayout::new(1, outer, tokens, page_elems / (outer * tokens), e)
            .map_err(|err| err.to_string())?;
        Ok((page, kv))
    }

    /// A paged layout from each tensor's page; `shape` gives the KV shape of one page (its
    /// `num_layers` is ignored: the layers are the distinct pages' bytes over one page's), and
    /// `tag` names the geometry for its id.
    ///
    /// A block's runs are built cluster by cluster: tensors whose block pages reach into each
    /// other's address span (interleaved layers, overlaid groups) form one cluster, whose bytes
    /// are the union of their pages in address order; clusters follow each other in
    /// registration order. So separate tensors keep their order wherever they were allocated,
    /// and one buffer's views follow memory order.
    fn paged(
        shape: KvLayout,
        num_blocks: usize,
        pages: &[Page],
        tag: &str,
    ) -> Result<Self, CoreError> {
        let mixed = pages
            .iter()
            .any(|p| p.page_bytes() != pages[0].page_bytes());
        // Block 0's intervals per tensor (absolute), and each tensor's span.
        let intervals: Vec<Vec<(u64, u64)>> = pages
            .iter()
            .map(|p| {
                p.runs()
                    .iter()
                    .map(|&(o, l)| (p.addr + o as u64, p.addr + (o + l) as u64))
                    .collect()
            })
            .collect();
        let span = |i: usize| (intervals[i][0].0, intervals[i].last().expect("a run").1);
        // Clusters of tensors with intersecting spans, in registration order of their first.
        let mut cluster_of: Vec<usize> = (0..pages.len()).collect();
        let mut by_start: Vec<usize> = (0..pages.len()).collect();
        by_start.sort_by_key(|&i| span(i));
        let mut reach: Option<(u64, usize)> = None; // (end of the current group, its cluster)
        for &i in &by_start {
            let (s, e) = span(i);
            match reach {
                Some((end, c)) if s < end => {
                    cluster_of[i] = c;
                    reach = Some((end.max(e), c));
                }
                _ => reach = Some((e, i)),
            }
        }
        // A cluster is named by one member; order clusters by their first member.
        let mut first_member: HashMap<usize, usize> = HashMap::new();
        for (i, &c) in cluster_of.iter().enumerate() {
            first_member.entry(c).or_insert(i);
        }
        let mut clusters: Vec<(usize, Vec<usize>)> = Vec::new();
        let mut index_of: HashMap<usize, usize> = HashMap::new();
        for (i, &c) in cluster_of.iter().enumerate() {
            let k = *index_of.entry(c).or_insert_with(|| {
                clusters.push((first_member[&c], Vec::new()));
                clusters.len() - 1
            });
            clusters[k].1.push(i);
        }
        clusters.sort_by_key(|(first, _)| *first);

        let mut runs: Vec<Run> = Vec::new();
        for (_, members) in &clusters {
            // Every member's intervals, tagged, in address order; then their union.
            let mut all: Vec<(u64, u64, u32)> = members
                .iter()
                .flat_map(|&i| intervals[i].iter().map(move |&(s, e)| (s, e, i as u32)))
                .collect();
            all.sort_unstable();
            let mut union: Vec<(u64, u64, u32, u32)> = Vec::new();
            for &(s, e, layer) in &all {
                match union.last_mut() {
                    Some(last) if s < last.1 => {
                        last.1 = last.1.max(e);
                        last.2 = last.2.min(layer);
                        last.3 = last.3.max(layer);
                    }
                    _ => union.push((s, e, layer, layer)),
                }
            }
            for (s, e, lo, hi) in union {
                push_run(&mut runs, s, (e - s) as usize, (lo, hi));
            }
        }
        // Per tensor, the last tag of the runs holding its bytes (its onboard readiness); the
        // runs never overlap, so each interval lies in the one starting at or before it.
        let mut by_addr: Vec<usize> = (0..runs.len()).collect();
        by_addr.sort_by_key(|&k| runs[k].addr);
        let mut ready: Vec<u32> = (0..pages.len() as u32).collect();
        for (i, tensor) in intervals.iter().enumerate() {
            for &(s, _) in tensor {
                let at = by_addr.partition_point(|&k| runs[k].addr <= s) - 1;
                ready[i] = ready[i].max(runs[by_addr[at]].layers.1);
            }
        }
        if runs.len() > RUNS_PER_BLOCK_MAX {
            return Err(CoreError::InvalidLayout(format!(
                "a block is {} runs (at most {RUNS_PER_BLOCK_MAX})",
                runs.len()
            )));
        }
        let total: usize = runs.iter().map(|r| r.len).sum();
        let page = shape.page_bytes();
        let kv = if total % page == 0 {
            KvLayout::new(
                total / page,
                shape.outer_dim,
                shape.block_size_tokens,
                shape.inner_dim,
                shape.dtype_bytes,
            )?
        } else if mixed {
            // Pages of several sizes (attention pages and Mamba states in slots no attention
            // layer uses): the block is described as its bytes, one layer of them.
            let tokens = shape.block_size_tokens;
            let tokens = if total % tokens == 0 { tokens } else { 1 };
            KvLayout::new(1, 1, tokens, total / tokens, 1)?
        } else {
            return Err(CoreError::InvalidLayout(format!(
                "the tensors hold {total} distinct bytes per block, not a whole number of \
                 {page}-byte pages"
            )));
        };
        // The canonical order: each cluster's members' page axes by stride and their offsets
        // from the cluster's start (not absolute addresses, which differ between runs).
        let mut id = format!("{tag};{kv:?};");
        for (_, members) in &clusters {
            let base = members.iter().map(|&i| span(i).0).min().expect("a member");
            for &i in members {
                let mut axes: Vec<Axis> = pages[i]
                    .axes
                    .iter()
                    .copied()
                    .filter(|a| a.size > 1)
                    .collect();
                axes.sort_by_key(|a| std::cmp::Reverse(a.stride));
                id.push_str(&format!("{}@{}:{axes:?};", i, span(i).0 - base));
            }
            id.push('|');
        }
        Ok(Self {
            kv,
            num_blocks,
            kind: LayoutKind::Paged {
                runs,
                block_stride_bytes: pages[0].block_stride as u64,
                geometry_id: xxhash_rust::xxh3::xxh3_64(id.as_bytes()),
                ready,
            },
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

    /// The same placement described with `kv`, which must have the same layers and bytes per
    /// block (vLLM 0.33's views cannot tell K and V apart inside their content axis; the caller
    /// can).
    pub fn with_kv(mut self, kv: KvLayout) -> Result<Self, CoreError> {
        if kv.num_layers != self.kv.num_layers || kv.bytes_per_block() != self.kv.bytes_per_block()
        {
            return Err(CoreError::InvalidLayout(format!(
                "{kv:?} does not describe the bytes of {:?}",
                self.kv
            )));
        }
        self.kv = kv;
        Ok(self)
    }

    /// Bytes from one block to the next in a fully contiguous layout.
    pub fn block_stride_bytes(&self) -> Option<usize> {
        match &self.kind {
            LayoutKind::FullyContiguous {
                block_stride_bytes, ..
            } => Some(*block_stride_bytes),
            LayoutKind::Paged { .. } => None,
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

    /// Contiguous runs per block (1 for a fully contiguous layout).
    pub fn runs_per_block(&self) -> usize {
        match &self.kind {
            LayoutKind::Paged { runs, .. } => runs.len(),
            LayoutKind::FullyContiguous { .. } => 1,
        }
    }

    /// Identifies the canonical order of a block's bytes: equal for layouts whose blocks can be
    /// copied into each other's host copies (a fully contiguous layout has none: 0).
    pub fn geometry_id(&self) -> u64 {
        match &self.kind {
            LayoutKind::Paged { geometry_id, .. } => *geometry_id,
            LayoutKind::FullyContiguous { .. } => 0,
        }
    }

    /// Address of the first byte of `block`'s data (a fully contiguous block's whole data
    /// follows it).
    #[inline]
    pub fn block_start(&self, block: usize) -> u64 {
        debug_assert!(block < self.num_blocks);
        match &self.kind {
            LayoutKind::Paged {
                runs,
                block_stride_bytes,
                ..
            } => runs[0].addr + block as u64 * block_stride_bytes,
            LayoutKind::FullyContiguous {
                base,
                block_stride_bytes,
                lead_bytes,
            } => base + (block * block_stride_bytes + lead_bytes) as u64,
        }
    }

    /// Calls `f(address, offset in canonical order, bytes, layers)` for each run of `block`.
    pub fn for_each_run(&self, block: usize, mut f: impl FnMut(u64, usize, usize, (u32, u32))) {
        match &self.kind {
            LayoutKind::Paged {
                runs,
                block_stride_bytes,
                ..
            } => {
                let shift = block as u64 * block_stride_bytes;
                for r in runs {
                    f(r.addr + shift, r.offset, r.len, r.layers);
                }
            }
            LayoutKind::FullyContiguous { .. } => f(
                self.block_start(block),
                0,
                self.kv.bytes_per_block(),
                (0, self.kv.num_layers.saturating_sub(1) as u32),
            ),
        }
    }

    /// For each tensor (layer), the last tensor of the runs holding its bytes: layer `l` is in
    /// place once the runs tagged up to `ready_after()[l]` are (runs merged across layers, as in
    /// a block-outermost layout, make a layer wait for the whole block).
    pub fn ready_after(&self) -> Vec<u32> {
        match &self.kind {
            LayoutKind::Paged { ready, .. } => ready.clone(),
            LayoutKind::FullyContiguous { .. } => {
                vec![self.kv.num_layers.saturating_sub(1) as u32; self.kv.num_layers]
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
        self.copy_runs_into(src_block, dst, dst_block, |_| true, out)
    }

    /// As [`Self::copy_pieces_into`], for the runs (of whichever side is paged) that `keep`
    /// accepts by their layers; with two paged sides, `self`'s runs decide.
    pub fn copy_runs_into(
        &self,
        src_block: usize,
        dst: &BlockLayout,
        dst_block: usize,
        keep: impl Fn((u32, u32)) -> bool,
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
        let first = out.len();
        let push = |src: u64, dst: u64, len: usize, out: &mut Vec<CopyPiece>| {
            if out.len() > first {
                let last = out.last_mut().expect("not empty");
                if last.src + last.len as u64 == src && last.dst + last.len as u64 == dst {
                    last.len += len;
                    return;
                }
            }
            out.push(CopyPiece { src, dst, len });
        };
        match (&self.kind, &dst.kind) {
            (LayoutKind::Paged { .. }, LayoutKind::FullyContiguous { .. }) => {
                let base = dst.block_start(dst_block);
                self.for_each_run(src_block, |addr, offset, len, layers| {
                    if keep(layers) {
                        push(addr, base + offset as u64, len, out);
                    }
                });
            }
            (LayoutKind::FullyContiguous { .. }, LayoutKind::Paged { .. }) => {
                let base = self.block_start(src_block);
                dst.for_each_run(dst_block, |addr, offset, len, layers| {
                    if keep(layers) {
                        push(base + offset as u64, addr, len, out);
                    }
                });
            }
            (LayoutKind::FullyContiguous { .. }, LayoutKind::FullyContiguous { .. }) => {
                let len = self.kv.bytes_per_block();
                push(
                    self.block_start(src_block),
                    dst.block_start(dst_block),
                    len,
                    out,
                );
            }
            (LayoutKind::Paged { .. }, LayoutKind::Paged { .. }) => {
                // Both sides split the canonical order differently: cut at both sides' runs.
                let mut theirs = Vec::with_capacity(dst.runs_per_block());
                dst.for_each_run(dst_block, |addr, offset, len, _| {
                    theirs.push((addr, offset, len))
                });
                let mut j = 0;
                self.for_each_run(src_block, |addr, offset, len, layers| {
                    let (mut at, end) = (offset, offset + len);
                    while at < end {
                        while theirs[j].1 + theirs[j].2 <= at {
                            j += 1;
                        }
                        let (d_addr, d_off, d_len) = theirs[j];
                        let step = (end.min(d_off + d_len)) - at;
                        if keep(layers) {
                            push(
                                addr + (at - offset) as u64,
                                d_addr + (at - d_off) as u64,
                                step,
                                out,
                            );
                        }
                        at += step;
                    }
                });
            }
        }
        Ok(())
    }
}

/// Appends a run, merged into the last one when it continues it.
fn push_run(runs: &mut Vec<Run>, addr: u64, len: usize, layers: (u32, u32)) {
    if let Some(last) = runs.last_mut() {
        if last.addr + last.len as u64 == addr {
            last.len += len;
            last.layers = (last.layers.0.min(layers.0), last.layers.1.max(layers.1));
            return;
        }
    }
    let offset = runs.last().map_or(0, |r| r.offset + r.len);
    runs.push(Run {
        addr,
        len,
        offset,
        layers,
    });
}

/// The vLLM 0.33 layout that equally spaced, equally shaped 4-D views follow, if any.
fn detect_physical(views: &[TensorView], pages: &[Page]) -> Option<PhysicalLayout> {
    let v = &views[0];
    if v.shape.len() != 4
        || views
            .iter()
            .any(|w| w.shape != v.shape || w.strides != v.strides)
    {
        return None;
    }
    // Byte strides of L, B, H, N (C is innermost); the layers must be equally spaced.
    let layer_stride = match pages {
        [_] => usize::MAX,
        [a, b, ..] => {
            let d = b.addr.checked_sub(a.addr)?;
            let uniform = pages
                .iter()
                .enumerate()
                .all(|(l, p)| p.addr == a.addr + l as u64 * d);
            if !uniform || d == 0 {
                return None;
            }
            d as usize
        }
        [] => return None,
    };
    let e = v.elem_bytes;
    let strides = [
        layer_stride,
        pages[0].block_stride,
        v.strides[1] * e,
        v.strides[2] * e,
    ];
    let sizes = [pages.len(), usize::MAX, v.shape[1], v.shape[2]];
    PhysicalLayout::ALL.into_iter().find(|layout| {
        // Axes of size 1 may carry any stride; the others must descend in the layout's order.
        let relevant: Vec<usize> = layout
            .stride_order()
            .iter()
            .copied()
            .filter(|&a| a != 4 && sizes[a] > 1)
            .collect();
        relevant.windows(2).all(|w| strides[w[0]] > strides[w[1]])
    })
}
