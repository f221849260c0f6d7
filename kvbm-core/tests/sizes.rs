//! Sizes from callers that do not fit are refused with an error naming the argument, before
//! anything is allocated or any arithmetic overflows.

use kvbm_core::leader::{check_sizes, BLOCK_SIZE_MAX};
use kvbm_core::requests::{Requests, Scheduled};
use kvbm_core::{host_range_writable, CoreError, Leader};

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
    // The constructor itself refuses instead of aborting on the allocation.
    assert!(matches!(
        Leader::new(16, 1 << 31, 0, false),
        Err(CoreError::InvalidArgument(_))
    ));
}

#[test]
fn token_counts_that_would_overflow_saturate() {
    let mut requests = Requests::new(4);
    let spans = requests.schedule(
        vec![Scheduled::New {
            request: "r".into(),
            block_ids: vec![0, 1],
            computed: usize::MAX,
            lora: None,
            salt: None,
        }],
        &[("r".into(), usize::MAX, 8)],
    );
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
