//! Copy pieces between layouts: vLLM's two per-layer shapes, MLA, and contiguous blocks.

use kvbm_core::{BlockLayout, KvLayout, LayerShape};
use kvbm_cuda::CopyPiece;

fn kv(layers: usize, outer: usize) -> KvLayout {
    // chunk = 4 tokens * 8 inner * 2 bytes = 64 bytes
    KvLayout::new(layers, outer, 4, 8, 2).unwrap()
}

fn piece(src: u64, dst: u64, len: usize) -> CopyPiece {
    CopyPiece { src, dst, len }
}

fn check(
    src: &BlockLayout,
    src_block: usize,
    dst: &BlockLayout,
    dst_block: usize,
    expected: &[CopyPiece],
) {
    let mut out = Vec::new();
    src.copy_pieces_into(src_block, dst, dst_block, &mut out)
        .unwrap();
    assert_eq!(
        out, expected,
        "{src:?} block {src_block} -> {dst:?} block {dst_block}"
    );
    let total: usize = out.iter().map(|p| p.len).sum();
    assert_eq!(total, src.kv().bytes_per_block());
}

#[test]
fn sizes_follow_the_shape() {
    let kv = KvLayout::new(28, 2, 16, 8 * 128, 2).unwrap(); // Qwen3-0.6B, bf16
    assert_eq!(kv.chunk_bytes(), 32 * 1024);
    assert_eq!(kv.chunks_per_block(), 56);
    assert_eq!(kv.bytes_per_block(), 56 * 32 * 1024);
    assert_eq!(kv.contiguous_stride_bytes(), kv.bytes_per_block());
    let odd = KvLayout::new(1, 1, 3, 5, 2).unwrap();
    assert_eq!(odd.bytes_per_block(), 30);
    assert_eq!(odd.contiguous_stride_bytes(), 4096);
}

#[test]
fn impossible_layouts_are_refused() {
    for (layers, outer, block, inner, dtype) in [
        (0, 2, 16, 8, 2),
        (2, 3, 16, 8, 2),
        (2, 0, 16, 8, 2),
        (2, 2, 0, 8, 2),
        (2, 2, 16, 0, 2),
        (2, 2, 16, 8, 0),
        (1 << 20, 2, 1 << 10, 1 << 10, 2),
    ] {
        assert!(
            KvLayout::new(layers, outer, block, inner, dtype).is_err(),
            "{layers} {outer} {block} {inner} {dtype}"
        );
    }
    assert!(BlockLayout::layer_separate(kv(2, 2), 4, LayerShape::OuterFirst, vec![0]).is_err());
}

#[test]
fn outer_first_gathers_every_chunk_separately() {
    // Layer tensors [2, 4 blocks, chunk] at 10_000 and 20_000; host blocks contiguous from 0.
    let gpu =
        BlockLayout::layer_separate(kv(2, 2), 4, LayerShape::OuterFirst, vec![10_000, 20_000])
            .unwrap();
    let host = BlockLayout::fully_contiguous(kv(2, 2), 8, 0);
    // GPU block 1: K at 10_000 + 1*64, V at 10_000 + (4+1)*64; host block 3 at 3*4096.
    check(
        &gpu,
        1,
        &host,
        3,
        &[
            piece(10_064, 12_288, 64),
            piece(10_320, 12_352, 64),
            piece(20_064, 12_416, 64),
            piece(20_320, 12_480, 64),
        ],
    );
}

#[test]
fn block_first_merges_k_and_v_of_a_layer() {
    let gpu =
        BlockLayout::layer_separate(kv(2, 2), 4, LayerShape::BlockFirst, vec![10_000, 20_000])
            .unwrap();
    let host = BlockLayout::fully_contiguous(kv(2, 2), 8, 0);
    // GPU block 2 in each layer: K at base + 4*64, V right after.
    check(
        &gpu,
        2,
        &host,
        0,
        &[piece(10_256, 0, 128), piece(20_256, 128, 128)],
    );
    // And back: the same pieces with the sides swapped.
    check(
        &host,
        0,
        &gpu,
        2,
        &[piece(0, 10_256, 128), piece(128, 20_256, 128)],
    );
}

#[test]
fn mla_has_one_chunk_per_layer_in_both_shapes() {
    let host = BlockLayout::fully_contiguous(kv(3, 1), 2, 1 << 20);
    for shape in [LayerShape::OuterFirst, LayerShape::BlockFirst] {
        let gpu =
            BlockLayout::layer_separate(kv(3, 1), 4, shape, vec![0, 100_000, 200_000]).unwrap();
        let base = 1 << 20;
        check(
            &gpu,
            3,
            &host,
            1,
            &[
                piece(192, base + 4096, 64),
                piece(100_192, base + 4096 + 64, 64),
                piece(200_192, base + 4096 + 128, 64),
            ],
        );
    }
}

#[test]
fn contiguous_to_contiguous_is_one_piece_per_block() {
    let a = BlockLayout::fully_contiguous(kv(4, 2), 4, 0);
    let b = BlockLayout::fully_contiguous(kv(4, 2), 4, 1 << 30);
    check(&a, 2, &b, 1, &[piece(8192, (1 << 30) + 4096, 512)]);
}

#[test]
fn mismatched_layouts_and_blocks_out_of_range_are_refused() {
    let a = BlockLayout::fully_contiguous(kv(4, 2), 4, 0);
    let b = BlockLayout::fully_contiguous(kv(4, 1), 4, 0);
    let mut out = Vec::new();
    assert!(a.copy_pieces_into(0, &b, 0, &mut out).is_err());
    assert!(a.copy_pieces_into(4, &a, 0, &mut out).is_err());
    assert!(out.is_empty());
}
