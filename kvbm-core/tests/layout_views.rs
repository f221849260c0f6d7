//! Paged layouts derived from tensor shapes and strides: vLLM 0.33's `[B, H, N, C]` views of one
//! backing buffer in every `KVCacheLayout`, kernel blocks, padded pages, overlaid cache groups,
//! the older 5-D tensors, and the layouts that must be refused.
//!
//! Memory is simulated: addresses are offsets into byte vectors (the "GPU" buffer at 0, host
//! blocks from `HOST_BASE`), and the copy pieces are applied to them. Every round trip is checked
//! element by element against the tensors' own strides, independently of the runs.

use kvbm_core::{
    BlockLayout, CoreError, GpuLayout, KvLayout, LayerShape, PagedShape, PhysicalLayout, TensorView,
};
use kvbm_cuda::CopyPiece;
use proptest::prelude::*;

const HOST_BASE: u64 = 1 << 40;

/// A byte address space: the GPU buffer at 0 and the host blocks at `HOST_BASE`.
struct Memory {
    gpu: Vec<u8>,
    host: Vec<u8>,
}

impl Memory {
    fn byte(&mut self, addr: u64) -> &mut u8 {
        if addr >= HOST_BASE {
            &mut self.host[(addr - HOST_BASE) as usize]
        } else {
            &mut self.gpu[addr as usize]
        }
    }

    fn apply(&mut self, pieces: &[CopyPiece]) {
        for p in pieces {
            for i in 0..p.len as u64 {
                let b = *self.byte(p.src + i);
                *self.byte(p.dst + i) = b;
            }
        }
    }
}

/// Every byte address of block `block` of view `v`, in (h, n, c, byte) order, for a view of
/// `blocks_per_block` kernel blocks per block.
fn element_bytes(v: &TensorView, block: usize, kernel_per_block: usize) -> Vec<u64> {
    let e = v.elem_bytes;
    let s = &v.strides;
    let mut out = Vec::new();
    for k in 0..kernel_per_block {
        let kb = block * kernel_per_block + k;
        for h in 0..v.shape[1] {
            for n in 0..v.shape[2] {
                for c in 0..v.shape[3] {
                    let elem = kb * s[0] + h * s[1] + n * s[2] + c * s[3];
                    for byte in 0..e {
                        out.push(v.addr + (elem * e + byte) as u64);
                    }
                }
            }
        }
    }
    out
}

/// Offloads block `from` into a host block, onboards it into block `to` of a cleared GPU
/// buffer, and checks every element of every view, and that nothing else was written.
fn check_round_trip(
    views: &[TensorView],
    buffer_bytes: usize,
    num_blocks: usize,
    kernel_per_block: usize,
    from: usize,
    to: usize,
) -> BlockLayout {
    let placed = BlockLayout::from_views(views, num_blocks).unwrap();
    let gpu = placed.layout;
    let host = BlockLayout::host(placed.kv, 2, HOST_BASE);
    let mut mem = Memory {
        gpu: (0..buffer_bytes).map(|i| (i * 7 % 251) as u8 + 1).collect(),
        host: vec![0; 2 * placed.kv.host_stride_bytes()],
    };
    let original = mem.gpu.clone();
    let mut pieces = Vec::new();
    gpu.copy_pieces_into(from, &host, 1, &mut pieces).unwrap();
    assert_eq!(pieces.len(), gpu.runs_per_block());
    let moved: usize = pieces.iter().map(|p| p.len).sum();
    assert_eq!(moved, placed.kv.bytes_per_block());
    mem.apply(&pieces);
    mem.gpu.iter_mut().for_each(|b| *b = 0);
    pieces.clear();
    host.copy_pieces_into(1, &gpu, to, &mut pieces).unwrap();
    mem.apply(&pieces);
    let mut written = vec![false; buffer_bytes];
    for v in views {
        let src = element_bytes(v, from, kernel_per_block);
        let dst = element_bytes(v, to, kernel_per_block);
        for (s, d) in src.iter().zip(&dst) {
            assert_eq!(
                mem.gpu[*d as usize], original[*s as usize],
                "{}: byte at {d} of block {to} (from {s} of block {from})",
                v.name
            );
            written[*d as usize] = true;
        }
    }
    for (i, b) in mem.gpu.iter().enumerate() {
        if !written[i] {
            assert_eq!(*b, 0, "byte {i} outside block {to} was written");
        }
    }
    gpu
}

fn shape(layers: usize, heads: usize, tokens: usize, content: usize, elem: usize) -> PagedShape {
    PagedShape {
        num_layers: layers,
        num_heads: heads,
        block_size_tokens: tokens,
        content_elems: content,
        elem_bytes: elem,
    }
}

/// (layout, runs per block for 3 layers of 2 heads).
const RUNS: [(PhysicalLayout, usize); 6] = [
    (PhysicalLayout::Lbnhc, 3),
    (PhysicalLayout::Lbhnc, 3),
    (PhysicalLayout::Lhbnc, 6),
    (PhysicalLayout::Blhnc, 1),
    (PhysicalLayout::Blnhc, 1),
    (PhysicalLayout::Bhlnc, 1),
];

#[test]
fn every_vllm_layout_round_trips_with_the_runs_its_strides_allow() {
    let s = shape(3, 2, 4, 6, 2);
    for (layout, runs) in RUNS {
        let views = layout.views(&s, 5, 0);
        let bytes = PhysicalLayout::buffer_bytes(&s, 5);
        let placed = BlockLayout::from_views(&views, 5).unwrap();
        assert_eq!(placed.physical, Some(layout), "{layout}");
        assert_eq!(placed.layout.runs_per_block(), runs, "{layout}");
        assert_eq!(placed.spans, vec![(0, bytes)], "{layout}: one buffer");
        assert_eq!(placed.kv.bytes_per_block(), 3 * s.page_bytes());
        check_round_trip(&views, bytes, 5, 1, 2, 4);
    }
}

#[test]
fn vllm_views_have_the_strides_vllm_gives_them() {
    // The reference file's example: LBNHC, 256 blocks, 8 heads, 16 tokens, C = 256.
    let s = shape(2, 8, 16, 256, 2);
    let views = PhysicalLayout::Lbnhc.views(&s, 256, 0);
    assert_eq!(views[0].shape, vec![256, 8, 16, 256]);
    assert_eq!(views[0].strides, vec![32768, 256, 2048, 1]);
    assert_eq!(views[1].addr, 256 * 32768 * 2);
    // BLNHC: a block holds every layer's page.
    let views = PhysicalLayout::Blnhc.views(&s, 256, 0);
    assert_eq!(views[0].strides, vec![2 * 32768, 256, 2048, 1]);
    assert_eq!(views[1].addr, 32768 * 2);
}

#[test]
fn layer_readiness_follows_the_runs() {
    let s = shape(3, 2, 4, 6, 2);
    let per_layer = BlockLayout::from_views(&PhysicalLayout::Lbnhc.views(&s, 4, 0), 4).unwrap();
    assert_eq!(per_layer.layout.ready_after(), vec![0, 1, 2]);
    let whole = BlockLayout::from_views(&PhysicalLayout::Blnhc.views(&s, 4, 0), 4).unwrap();
    assert_eq!(whole.layout.ready_after(), vec![2, 2, 2]);
}

#[test]
fn kernel_blocks_make_one_block_of_several() {
    // vLLM splits a 8-token block into two 4-token kernel blocks: the view has twice the blocks.
    let s = shape(2, 2, 4, 6, 2);
    let views = PhysicalLayout::Lbnhc.views(&s, 8, 0);
    let placed = BlockLayout::from_views(&views, 4).unwrap();
    assert_eq!(placed.kv.block_size_tokens, 8);
    assert_eq!(placed.layout.runs_per_block(), 2);
    check_round_trip(&views, PhysicalLayout::buffer_bytes(&s, 8), 4, 2, 1, 3);
}

#[test]
fn padded_pages_move_only_their_data() {
    // LBNHC with each page padded to 512 bytes (vLLM's page_size_padded): block stride 512.
    let (heads, tokens, content, e, blocks) = (2, 4, 6, 2, 3);
    let page = heads * tokens * content * e; // 96 bytes
    let padded_elems = 512 / e;
    let views: Vec<TensorView> = (0..2)
        .map(|l| TensorView {
            name: format!("model.layers.{l}.self_attn"),
            addr: (l * blocks * 512) as u64,
            shape: vec![blocks, heads, tokens, content],
            strides: vec![padded_elems, content, heads * content, 1],
            elem_bytes: e,
        })
        .collect();
    let gpu = check_round_trip(&views, 2 * blocks * 512, blocks, 1, 0, 2);
    assert_eq!(gpu.kv().bytes_per_block(), 2 * page);
    assert_eq!(gpu.runs_per_block(), 2);
}

#[test]
fn overlaid_groups_are_copied_once() {
    let s = shape(2, 2, 4, 6, 2);
    for layout in [PhysicalLayout::Lbnhc, PhysicalLayout::Blnhc] {
        // A second cache group over the same bytes with another head split (block-compact
        // layouts let groups reinterpret [H, N, C]), plus a layer sharing another's cache.
        let mut views = layout.views(&s, 4, 0);
        let other = shape(2, 1, 4, 12, 2);
        for mut v in layout.views(&other, 4, 0) {
            v.name = format!("group1.{}", v.name);
            views.push(v);
        }
        let mut shared = views[0].clone();
        shared.name = "shared".into();
        views.push(shared);
        let placed = BlockLayout::from_views(&views, 4).unwrap();
        assert_eq!(placed.kv.bytes_per_block(), 2 * s.page_bytes(), "{layout}");
        assert_eq!(placed.kv.num_layers, 2);
        check_round_trip(&views, PhysicalLayout::buffer_bytes(&s, 4), 4, 1, 3, 0);
    }
}

/// A contiguous 5-D tensor of the older releases at `addr`.
fn five_d(name: &str, addr: u64, shape: [usize; 5], elem: usize) -> TensorView {
    let mut strides = vec![1usize; 5];
    for i in (0..4).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    TensorView {
        name: name.into(),
        addr,
        shape: shape.to_vec(),
        strides,
        elem_bytes: elem,
    }
}

#[test]
fn older_five_d_tensors_give_the_pieces_of_the_older_shapes() {
    let kv = KvLayout::new(2, 2, 4, 2 * 3, 2).unwrap(); // chunk 48 bytes
    let host = BlockLayout::fully_contiguous(kv, 4, HOST_BASE);
    for (shape, dims) in [
        (LayerShape::OuterFirst, [2, 5, 4, 2, 3]),
        (LayerShape::BlockFirst, [5, 2, 4, 2, 3]),
    ] {
        let views = [
            five_d("l0", 10_000, dims, 2),
            five_d("l1", 100_000, dims, 2),
        ];
        let placed = BlockLayout::from_views(&views, 5).unwrap();
        assert_eq!(placed.kv, kv);
        assert_eq!(placed.physical, None);
        let legacy = BlockLayout::layer_separate(kv, 5, shape, vec![10_000, 100_000]).unwrap();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        placed.layout.copy_pieces_into(3, &host, 2, &mut a).unwrap();
        legacy.copy_pieces_into(3, &host, 2, &mut b).unwrap();
        assert_eq!(a, b, "{shape:?}");
        assert_eq!(
            a.len(),
            if shape == LayerShape::OuterFirst {
                4
            } else {
                2
            }
        );
        assert_eq!(placed.spans.len(), 2, "two allocations, two regions");
    }
}

#[test]
fn mla_views_are_one_run_per_layer_or_per_block() {
    // vLLM 0.33's MLA view is [B, 1, N, C]; older releases gave [B, N, D].
    let s = shape(3, 1, 4, 10, 2);
    let placed = BlockLayout::from_views(&PhysicalLayout::Lbnhc.views(&s, 4, 0), 4).unwrap();
    assert_eq!(placed.layout.runs_per_block(), 3);
    let placed = BlockLayout::from_views(&PhysicalLayout::Blnhc.views(&s, 4, 0), 4).unwrap();
    assert_eq!(placed.layout.runs_per_block(), 1);
    let old = [TensorView {
        name: "mla".into(),
        addr: 0,
        shape: vec![4, 4, 10],
        strides: vec![40, 10, 1],
        elem_bytes: 2,
    }];
    let placed = BlockLayout::from_views(&old, 4).unwrap();
    assert_eq!(placed.kv.bytes_per_block(), 80);
    assert_eq!(placed.layout.runs_per_block(), 1);
}

#[test]
fn the_geometry_id_names_the_order_of_a_blocks_bytes() {
    let s = shape(3, 2, 4, 6, 2);
    let id = |layout: PhysicalLayout, base: u64| {
        BlockLayout::from_views(&layout.views(&s, 4, base), 4)
            .unwrap()
            .layout
            .geometry_id()
    };
    assert_eq!(
        id(PhysicalLayout::Lbnhc, 0),
        id(PhysicalLayout::Lbnhc, 1 << 30)
    );
    let ids: std::collections::HashSet<u64> =
        PhysicalLayout::ALL.iter().map(|&l| id(l, 0)).collect();
    assert_eq!(ids.len(), 6, "every layout orders a block differently");
    // Older per-layer tensors keep one id wherever the allocations land.
    let kv = KvLayout::new(2, 2, 4, 6, 2).unwrap();
    let legacy = |bases: Vec<u64>| {
        BlockLayout::layer_separate(kv, 4, LayerShape::OuterFirst, bases)
            .unwrap()
            .geometry_id()
    };
    assert_eq!(legacy(vec![0, 1 << 20]), legacy(vec![1 << 30, 1 << 24]));
}

#[test]
fn the_manager_places_vllm_layouts_in_one_allocation() {
    let kv = KvLayout::new(3, 2, 4, 2 * 3, 2).unwrap();
    let layout = GpuLayout::Paged {
        layout: PhysicalLayout::Blnhc,
        num_heads: 2,
    };
    assert_eq!(
        layout.allocation_bytes(&kv, 5),
        vec![5 * kv.bytes_per_block()]
    );
    let placed = layout.place(kv, 5, &[1 << 20]).unwrap();
    assert_eq!(placed.kv(), &kv);
    assert_eq!(placed.runs_per_block(), 1);
    assert!(layout.place(kv, 5, &[0, 1]).is_err());
    assert!(GpuLayout::Paged {
        layout: PhysicalLayout::Lbnhc,
        num_heads: 4
    }
    .place(kv, 5, &[0])
    .is_err());
}

#[test]
fn layout_names_parse_as_vllm_writes_them() {
    for layout in PhysicalLayout::ALL {
        assert_eq!(layout.name().parse::<PhysicalLayout>().unwrap(), layout);
        assert_eq!(
            layout
                .name()
                .to_lowercase()
                .parse::<PhysicalLayout>()
                .unwrap(),
            layout
        );
    }
    assert_eq!(
        "NHD".parse::<PhysicalLayout>().unwrap(),
        PhysicalLayout::Lbnhc
    );
    assert_eq!(
        "HND".parse::<PhysicalLayout>().unwrap(),
        PhysicalLayout::Lbhnc
    );
    assert!("LNBHC".parse::<PhysicalLayout>().is_err());
    assert!(PhysicalLayout::Bhlnc.is_block_outermost());
    assert!(!PhysicalLayout::Lhbnc.is_block_compact());
}

fn refused(views: &[TensorView], blocks: usize, words: &[&str]) {
    match BlockLayout::from_views(views, blocks) {
        Err(CoreError::InvalidLayout(msg)) => {
            for w in words {
                assert!(msg.contains(w), "{msg:?} lacks {w:?}");
            }
            assert!(msg.contains("BLNHC"), "{msg:?} says what is supported");
        }
        other => panic!("{views:?} accepted: {other:?}"),
    }
}

#[test]
fn layouts_that_cannot_be_addressed_are_refused_with_the_tensor_named() {
    let good = PhysicalLayout::Lbnhc.views(&shape(2, 2, 4, 6, 2), 4, 0);
    // The content axis transposed: not contiguous.
    let mut v = good[0].clone();
    v.strides = vec![48, 1, 12, 2];
    refused(
        &[v],
        4,
        &["layer.0", "[4, 2, 4, 6]", "[48, 1, 12, 2]", "contiguous"],
    );
    // Heads that overlap each other.
    let mut v = good[0].clone();
    v.strides = vec![48, 0, 12, 1];
    refused(&[v], 4, &["layer.0", "share bytes"]);
    // Blocks that overlap.
    let mut v = good[0].clone();
    v.strides = vec![20, 6, 12, 1];
    refused(&[v], 4, &["share bytes"]);
    // Another block count than the engine's, and an unknown rank.
    refused(&good[..1], 3, &["not a multiple"]);
    let mut v = good[0].clone();
    v.shape.push(1);
    v.strides.push(1);
    v.shape[0] = 3;
    v.shape[1] = 3;
    refused(&[v], 4, &["K/V axis"]);
    // Two tensors whose blocks lie at different distances.
    let mut v = good[1].clone();
    v.strides[0] *= 2;
    refused(&[good[0].clone(), v], 4, &["layer.1", "apart"]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Any vLLM layout and shape, with or without kernel blocks and an overlaid group: every
    /// byte of a block comes back, nothing else is written.
    #[test]
    fn any_layout_round_trips(
        layout_index in 0usize..6,
        layers in 1usize..4,
        heads in 1usize..4,
        tokens in 1usize..4,
        content in 1usize..5,
        elem in 1usize..3,
        blocks in 1usize..5,
        kernel in 1usize..3,
        overlay in any::<bool>(),
        from_to in (0usize..64, 0usize..64),
    ) {
        let layout = PhysicalLayout::ALL[layout_index];
        let s = shape(layers, heads, tokens, content, elem);
        let mut views = layout.views(&s, blocks * kernel, 0);
        if overlay && layout.is_block_compact() {
            let flat = shape(layers, 1, tokens, heads * content, elem);
            views.extend(layout.views(&flat, blocks * kernel, 0));
        }
        let bytes = PhysicalLayout::buffer_bytes(&s, blocks * kernel);
        check_round_trip(&views, bytes, blocks, kernel, from_to.0 % blocks, from_to.1 % blocks);
    }
}

/// vLLM 0.33's views of a Mamba hybrid (Qwen3-Next's shape: Mamba / linear-attention groups
/// first, then full attention), all over one buffer from byte 0 (`get_kv_cache_config_from_groups`
/// in `vllm/v1/core/kv_cache_planning.py`: "groups alias from byte 0"): `mamba_groups` groups of
/// `mamba_slots` 1-byte `[B, 1, 1, state]` views (`create_kv_cache_views` views a `MambaSpec`,
/// which has no dtype, as int8), each page padded to the attention page, then one attention
/// group of `attn_slots` `[B, H, N, C]` views of `s`.
fn hybrid_views(
    layout: PhysicalLayout,
    s: &PagedShape,
    num_blocks: usize,
    mamba_groups: usize,
    mamba_slots: usize,
    attn_slots: usize,
    state: usize,
) -> Vec<TensorView> {
    let page = s.page_bytes();
    let slots = mamba_slots.max(attn_slots);
    // compute_layout_strides with the planner's fixed layer and block strides.
    let (layer_stride, block_stride) = if layout.is_block_outermost() {
        (page, slots * page)
    } else {
        (num_blocks * page, page)
    };
    let mut views = Vec::new();
    for g in 0..mamba_groups {
        for l in 0..mamba_slots {
            views.push(TensorView {
                name: format!("model.layers.{}.linear_attn", g * mamba_slots + l),
                addr: (l * layer_stride) as u64,
                shape: vec![num_blocks, 1, 1, state],
                strides: vec![block_stride, state, state, 1],
                elem_bytes: 1,
            });
        }
    }
    let attn = PagedShape {
        num_layers: attn_slots,
        ..*s
    };
    // The attention group's views over the same slots (its strides, the planner's strides).
    for (l, mut v) in layout.views(&attn, num_blocks, 0).into_iter().enumerate() {
        v.name = format!("model.layers.{}.self_attn", mamba_groups * mamba_slots + l);
        v.addr = (l * layer_stride) as u64;
        v.strides[0] = block_stride / s.elem_bytes;
        views.push(v);
    }
    views
}

#[test]
fn mamba_hybrid_views_are_the_attention_pages_copied_once() {
    let s = shape(3, 2, 4, 6, 2); // 96-byte attention pages
    let (blocks, state) = (5, 40);
    for layout in [PhysicalLayout::Lbnhc, PhysicalLayout::Blnhc] {
        let views = hybrid_views(layout, &s, blocks, 2, 3, 3, state);
        let placed = BlockLayout::from_views(&views, blocks).unwrap();
        assert_eq!(placed.kv.bytes_per_block(), 3 * s.page_bytes(), "{layout}");
        assert_eq!(placed.kv.num_layers, 3, "{layout}");
        assert_eq!(
            placed.kv.dtype_bytes, 2,
            "{layout}: the attention pages describe it"
        );
        assert_eq!(placed.physical, Some(layout));
        let runs = if layout.is_block_outermost() { 1 } else { 3 };
        assert_eq!(placed.layout.runs_per_block(), runs, "{layout}");
        check_round_trip(
            &views,
            PhysicalLayout::buffer_bytes(&s, blocks),
            blocks,
            1,
            4,
            1,
        );
        // The attention layers (tensors 6, 7, 8) wait for their own slot's run under LBNHC,
        // even though the run also holds two Mamba states registered before them.
        let ready = placed.layout.ready_after();
        let expected: Vec<u32> = if layout.is_block_outermost() {
            vec![8; 9]
        } else {
            (0..9).map(|i| 6 + i % 3).collect()
        };
        assert_eq!(ready, expected, "{layout}");
    }
}

#[test]
fn mamba_states_in_slots_without_attention_are_copied_too() {
    // vLLM makes groups of the largest layer count when the counts are close
    // (`_get_kv_cache_groups_uniform_page_size`): a slot may hold Mamba states only.
    let s = shape(2, 2, 4, 6, 2);
    let (blocks, state) = (4, 40);
    for layout in [PhysicalLayout::Lbnhc, PhysicalLayout::Blnhc] {
        let views = hybrid_views(layout, &s, blocks, 1, 3, 2, state);
        let placed = BlockLayout::from_views(&views, blocks).unwrap();
        assert_eq!(
            placed.kv.bytes_per_block(),
            2 * s.page_bytes() + state,
            "{layout}"
        );
        let buffer = 3 * blocks * s.page_bytes();
        check_round_trip(&views, buffer, blocks, 1, 0, 3);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Any hybrid shape vLLM pads (layouts whose L and B axes are outermost): Mamba groups of
    /// any state size up to the attention page next to an attention group, slots covered by
    /// attention or not: every byte of every view's block comes back, nothing else is written.
    #[test]
    fn any_mamba_hybrid_round_trips(
        compact_index in 0usize..4,
        heads in 1usize..3,
        tokens in 1usize..4,
        content in 1usize..5,
        elem in 1usize..3,
        blocks in 1usize..5,
        mamba_groups in 1usize..4,
        slots in (1usize..4, 1usize..4),
        state_part in 1usize..=100,
        from_to in (0usize..64, 0usize..64),
    ) {
        let compact: Vec<PhysicalLayout> =
            PhysicalLayout::ALL.into_iter().filter(|l| l.is_block_compact()).collect();
        let layout = compact[compact_index % compact.len()];
        let s = shape(1, heads, tokens, content, elem);
        let state = (s.page_bytes() * state_part).div_ceil(100);
        let views = hybrid_views(layout, &s, blocks, mamba_groups, slots.0, slots.1, state);
        let bytes = slots.0.max(slots.1) * blocks * s.page_bytes();
        check_round_trip(&views, bytes, blocks, 1, from_to.0 % blocks, from_to.1 % blocks);
    }
}
