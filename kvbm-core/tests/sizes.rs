//! Sizes from callers that do not fit are refused with an error naming the argument, before
//! anything is allocated or any arithmetic overflows.

use kvbm_core::leader::{check_sizes, BLOCK_SIZE_MAX};
use kvbm_core::requests::{Requests, Scheduled};
use kvbm_core::{first_unwritable_range, host_range_writable, CoreError, Leader};

const GIB: u64 = 1 << 30;

#[test]
fn leader_sizes_beyond_memory_or_bounds_name_the_argument() {
    let refused = |r: Result<(), CoreError>, name: &str| match r {
        Err(CoreError::InvalidArgument(m)) => assert!(m.contains(name), "{m}"),
        other => panic!("expected {name} refused, got {other:?}"),
    };
    refused(
        check_sizes(16, 1 << 31, 0, 16 * GIB),
        "host_blocks=2147483648",
    );
    refused(
        check_sizes(16, 4, 1 << 31, 16 * GIB),
        "disk_blocks=2147483648",
    );
    refused(
        check_sizes(BLOCK_SIZE_MAX + 1, 4, 0, 16 * GIB),
        "block_size=",
    );
    refused(
        check_sizes(16, 1 << 26, 1 << 26, 16 * GIB),
        "host_blocks=67108864 and",
    );
    check_sizes(16, 1 << 20, 1 << 22, 16 * GIB).unwrap();
    // The constructor itself refuses instead of aborting on the allocation, with a size refused
    // on any machine whatever its memory (beyond 32-bit block ids).
    refused(
        Leader::new(16, 1 << 32, 0, false).map(drop),
        "host_blocks=4294967296",
    );
}

#[test]
fn each_bound_is_named_on_its_own() {
    let message = |r: Result<(), CoreError>| match r {
        Err(CoreError::InvalidArgument(m)) => m,
        other => panic!("expected a refusal, got {other:?}"),
    };
    // Memory is the check's argument: a machine of 1 TiB or of 16 EiB gives the same answers.
    let ids = message(check_sizes(16, 1 << 32, 0, u64::MAX));
    assert!(ids.contains("32-bit") && !ids.contains("memory"), "{ids}");
    let ids = message(check_sizes(16, 4, u32::MAX as usize, u64::MAX));
    assert!(
        ids.contains("disk_blocks=") && ids.contains("32-bit"),
        "{ids}"
    );
    // 1 << 31 blocks fit the ids: refused on a 256 GiB machine, accepted on a 1 TiB one.
    let memory = message(check_sizes(16, 1 << 31, 0, 256 * GIB));
    assert!(
        memory.contains("half of") && !memory.contains("32-bit"),
        "{memory}"
    );
    check_sizes(16, 1 << 31, 0, 1024 * GIB).unwrap();
    let tiny = message(check_sizes(16, 1 << 10, 0, 64 * 1024));
    assert!(
        tiny.contains("host_blocks=1024") && tiny.contains("65536 bytes"),
        "{tiny}"
    );
}

#[test]
fn token_counts_that_would_overflow_saturate() {
    let mut requests = Requests::new(4);
    let spans = requests
        .schedule(
            vec![Scheduled::New {
                request: "r".into(),
                block_ids: vec![vec![0, 1]],
                computed: usize::MAX,
                lora: None,
                salt: None,
            }],
            &[("r".into(), usize::MAX, 8)],
        )
        .unwrap();
    assert_eq!(spans.len(), 1);
    assert_eq!(spans[0].end_token, 8);
}

static READ_ONLY: [u8; 8192] = [7; 8192];

#[test]
fn read_only_memory_is_not_writable_host_memory() {
    let ro = READ_ONLY.as_ptr() as u64;
    assert!(!host_range_writable(ro, READ_ONLY.len() as u64).unwrap());
    let heap = vec![0u8; 1 << 20];
    assert!(host_range_writable(heap.as_ptr() as u64, heap.len() as u64).unwrap());
    assert!(!host_range_writable(heap.as_ptr() as u64, u64::MAX).unwrap());
    assert!(
        !host_range_writable(8, 8).unwrap(),
        "page 0 is mapped by nobody"
    );
}

#[test]
fn the_first_unwritable_range_is_named_by_its_index() {
    let heap = vec![0u8; 1 << 16];
    let (h, ro) = (heap.as_ptr() as u64, READ_ONLY.as_ptr() as u64);
    let ranges = [(h, 4096), (h + 4096, 4096), (ro, 4096), (h, 8)];
    assert_eq!(first_unwritable_range(&ranges).unwrap(), Some(2));
    assert_eq!(first_unwritable_range(&ranges[..2]).unwrap(), None);
    assert_eq!(first_unwritable_range(&[]).unwrap(), None);
}
