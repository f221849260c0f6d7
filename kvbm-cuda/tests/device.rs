//! The device layer end to end. The tests run on the device `KVBM_DEVICE` names (`auto`: CUDA
//! when a driver and a GPU exist, else the emulated device); `scripts/test.sh` runs them a
//! second time with `KVBM_DEVICE=cuda` on the simulated driver (kvbm-cuda-sim, strict, jittered),
//! so every one of them also checks the CUDA back end. A test that needs what only the emulated
//! device offers (holding a stream) says so and opens it.

use std::time::Duration;

use kvbm_cuda::{
    coalesce, BackendChoice, CopyPiece, Device, DeviceError, DeviceKind, Direction,
    HostRegionOptions, PinStatus, StreamOptions, Transfer,
};
use rand::{Rng, RngCore, SeedableRng};

/// The device under test: the one `KVBM_DEVICE` names.
fn device() -> Device {
    Device::from_env(0).expect("KVBM_DEVICE names a device this machine has")
}

/// A D2H stream with coalescing on or off, batched copies where the driver has them.
fn d2h_stream(device: &Device, coalesce: bool) -> kvbm_cuda::CopyStream {
    device
        .copy_stream_with(
            Direction::DeviceToHost,
            StreamOptions {
                coalesce,
                batch_copy: true,
            },
        )
        .unwrap()
}

fn small_host_options() -> HostRegionOptions {
    HostRegionOptions {
        chunk_bytes: 64 << 10,
        pin_threads: 2,
        huge_pages: false,
    }
}

fn ready_host(device: &Device, len: usize) -> kvbm_cuda::HostRegion {
    let host = device.alloc_host(len, small_host_options()).unwrap();
    assert!(
        host.wait_ready(len, Duration::from_secs(60)),
        "host region never became ready"
    );
    host
}

#[test]
fn backend_names_parse_and_nonsense_is_refused() {
    assert_eq!(
        "auto".parse::<BackendChoice>().unwrap(),
        BackendChoice::Auto
    );
    assert_eq!(
        "CUDA".parse::<BackendChoice>().unwrap(),
        BackendChoice::Cuda
    );
    assert_eq!(
        "emulated".parse::<BackendChoice>().unwrap(),
        BackendChoice::Emulated
    );
    let err = "tpu".parse::<BackendChoice>().unwrap_err().to_string();
    assert!(err.contains("KVBM_DEVICE") && err.contains("tpu"), "{err}");
}

#[test]
fn without_a_driver_cuda_is_an_error_and_auto_falls_back() {
    // The test runs on machines with and without a GPU: it asserts what each kind must do,
    // and above all that neither call panics.
    let auto = Device::open(BackendChoice::Auto, 0).expect("auto never fails");
    match Device::open(BackendChoice::Cuda, 0) {
        Err(DeviceError::NoDriver) => assert_eq!(auto.kind(), DeviceKind::Emulated),
        Err(other) => {
            // A driver without a usable GPU: still an error, and auto still falls back.
            assert_eq!(auto.kind(), DeviceKind::Emulated, "{other}");
        }
        Ok(cuda) => assert_eq!(cuda.kind(), DeviceKind::Cuda),
    }
    assert_eq!(
        Device::open(BackendChoice::Emulated, 0).unwrap().kind(),
        DeviceKind::Emulated
    );
}

#[test]
fn gather_offload_and_scatter_onboard_are_byte_exact() {
    let seed = rand::random::<u64>();
    println!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let device = device();
    let len = 1 << 20;
    let gpu = device.alloc_gpu(len).unwrap();
    let host = ready_host(&device, len);
    let mut original = vec![0u8; len];
    rng.fill_bytes(&mut original);
    gpu.write(0, &original).unwrap();

    // Random disjoint pieces: a permutation of 4 KiB pages, gathered into host order.
    let page = 4096;
    let pages = len / page;
    let mut order: Vec<usize> = (0..pages).collect();
    for i in (1..pages).rev() {
        order.swap(i, rng.gen_range(0..=i));
    }
    let d2h = device.copy_stream(Direction::DeviceToHost).unwrap();
    let h2d = device.copy_stream(Direction::HostToDevice).unwrap();
    let mut t = Transfer::with_capacity(pages);
    for (host_page, &gpu_page) in order.iter().enumerate() {
        t.push(
            gpu.addr() + (gpu_page * page) as u64,
            host.addr() + (host_page * page) as u64,
            page,
        );
    }
    t.keep(gpu.clone());
    t.keep(host.clone());
    d2h.submit(t).unwrap().wait().unwrap();
    let mut staged = vec![0u8; len];
    host.read(0, &mut staged).unwrap();
    for (host_page, &gpu_page) in order.iter().enumerate() {
        assert_eq!(
            staged[host_page * page..][..page],
            original[gpu_page * page..][..page],
            "host page {host_page}"
        );
    }

    gpu.write(0, &vec![0xA5; len]).unwrap();
    let mut t = Transfer::with_capacity(pages);
    for (host_page, &gpu_page) in order.iter().enumerate() {
        t.push(
            host.addr() + (host_page * page) as u64,
            gpu.addr() + (gpu_page * page) as u64,
            page,
        );
    }
    t.keep(gpu.clone());
    t.keep(host.clone());
    let done = h2d.submit(t).unwrap();
    assert!(done.wait_timeout(Duration::from_secs(30)).unwrap());
    assert!(done.poll().unwrap());
    let mut back = vec![0u8; len];
    gpu.read(0, &mut back).unwrap();
    assert!(
        back == original,
        "onboarded bytes differ from the originals"
    );
    assert_eq!(d2h.stats().pieces_submitted, pages as u64);
}

#[test]
fn transfers_on_one_stream_complete_in_order() {
    let device = device();
    let gpu = device.alloc_gpu(4096).unwrap();
    let host = ready_host(&device, 4096);
    let stream = device.copy_stream(Direction::HostToDevice).unwrap();
    // Each transfer writes its own value over the same bytes; the last one must win.
    let mut completions = Vec::new();
    for v in 0..50u8 {
        host.write(usize::from(v) * 64 % 4096, &[v; 64]).unwrap();
    }
    for v in 0..50u8 {
        let mut t = Transfer::default();
        t.push(
            host.addr() + (usize::from(v) * 64 % 4096) as u64,
            gpu.addr(),
            64,
        );
        t.keep(gpu.clone());
        t.keep(host.clone());
        completions.push(stream.submit(t).unwrap());
    }
    completions.last().unwrap().wait().unwrap();
    assert!(
        completions.iter().all(|c| c.poll().unwrap()),
        "an earlier transfer is unfinished"
    );
    let mut out = [0u8; 64];
    gpu.read(0, &mut out).unwrap();
    assert_eq!(out, [49u8; 64]);
}

#[test]
fn the_stream_keeps_regions_alive_after_the_caller_lets_go() {
    let device = device();
    let len = 8 << 20;
    let host = ready_host(&device, len);
    host.write(0, &vec![7u8; len]).unwrap();
    let gpu = device.alloc_gpu(len).unwrap();
    let stream = device.copy_stream(Direction::HostToDevice).unwrap();
    let mut t = Transfer::default();
    for i in 0..(len / 4096) {
        t.push(
            host.addr() + (i * 4096) as u64,
            gpu.addr() + (i * 4096) as u64,
            4096,
        );
    }
    t.keep(host);
    t.keep(gpu.clone());
    // Drop the completion and our only handle to the source at once.
    drop(stream.submit(t).unwrap());
    drop(stream); // finishes queued work
    let mut out = vec![0u8; len];
    gpu.read(0, &mut out).unwrap();
    assert!(out.iter().all(|&b| b == 7));
}

fn check_refused(
    direction: Direction,
    build: impl FnOnce(&mut Transfer, &kvbm_cuda::GpuRegion, &kvbm_cuda::HostRegion),
) -> DeviceError {
    let device = device();
    let gpu = device.alloc_gpu(8192).unwrap();
    let host = ready_host(&device, 8192);
    let stream = device.copy_stream(direction).unwrap();
    let mut t = Transfer::default();
    build(&mut t, &gpu, &host);
    stream.submit(t).expect_err("submit should be refused")
}

#[test]
fn pieces_outside_their_regions_are_refused() {
    // Past the end of the source.
    let err = check_refused(Direction::DeviceToHost, |t, g, h| {
        t.push(g.addr() + 8000, h.addr(), 4096);
        t.keep(g.clone());
        t.keep(h.clone());
    });
    assert!(
        matches!(err, DeviceError::OutOfBounds { side: "source", .. }),
        "{err}"
    );
    // Right addresses, wrong direction: a host source on a D2H stream.
    let err = check_refused(Direction::DeviceToHost, |t, g, h| {
        t.push(h.addr(), g.addr(), 4096);
        t.keep(g.clone());
        t.keep(h.clone());
    });
    assert!(matches!(err, DeviceError::OutOfBounds { .. }), "{err}");
    // A region not handed in with the transfer.
    let err = check_refused(Direction::HostToDevice, |t, g, h| {
        t.push(h.addr(), g.addr(), 4096);
        t.keep(h.clone());
    });
    assert!(
        matches!(err, DeviceError::OutOfBounds { side: "target", .. }),
        "{err}"
    );
    // Zero length.
    let err = check_refused(Direction::HostToDevice, |t, g, h| {
        t.push(h.addr(), g.addr(), 0);
        t.keep(g.clone());
        t.keep(h.clone());
    });
    assert!(matches!(err, DeviceError::InvalidArgument(_)), "{err}");
}

#[test]
fn coalescing_merges_only_pieces_that_continue_on_both_sides() {
    let p = |src, dst, len| CopyPiece { src, dst, len };
    let cases: Vec<(Vec<CopyPiece>, Vec<CopyPiece>)> = vec![
        (vec![], vec![]),
        (
            vec![p(0, 100, 10), p(10, 110, 10), p(20, 120, 5)],
            vec![p(0, 100, 25)],
        ),
        (
            vec![p(0, 100, 10), p(10, 200, 10)],
            vec![p(0, 100, 10), p(10, 200, 10)],
        ),
        (
            vec![p(0, 100, 10), p(50, 110, 10)],
            vec![p(0, 100, 10), p(50, 110, 10)],
        ),
        (
            vec![p(0, 0, 4), p(4, 4, 4), p(100, 8, 4), p(104, 12, 4)],
            vec![p(0, 0, 8), p(100, 8, 8)],
        ),
    ];
    for (input, expected) in cases {
        let mut pieces = input.clone();
        assert_eq!(coalesce(&mut pieces), expected.len());
        assert_eq!(pieces, expected, "input {input:?}");
    }
}

#[test]
fn coalescing_off_and_on_copy_the_same_bytes() {
    let device = device();
    let gpu = device.alloc_gpu(1 << 16).unwrap();
    let host = ready_host(&device, 1 << 16);
    let data: Vec<u8> = (0..1 << 16).map(|i| (i * 31 % 251) as u8).collect();
    gpu.write(0, &data).unwrap();
    for coalesce in [false, true] {
        let stream = d2h_stream(&device, coalesce);
        host.write(0, &vec![0u8; 1 << 16]).unwrap();
        let mut t = Transfer::default();
        for i in 0..16 {
            t.push(gpu.addr() + i * 4096, host.addr() + i * 4096, 4096);
        }
        t.keep(gpu.clone());
        t.keep(host.clone());
        stream.submit(t).unwrap().wait().unwrap();
        let mut out = vec![0u8; 1 << 16];
        host.read(0, &mut out).unwrap();
        assert!(out == data, "coalesce={coalesce}");
        let stats = stream.stats();
        assert_eq!(stats.pieces_submitted, 16);
        assert_eq!(stats.copies_issued, if coalesce { 1 } else { 16 });
    }
}

#[test]
fn copies_never_cross_a_host_pinning_chunk_or_a_gpu_region() {
    // Each pinning chunk of a host region is its own registration: a driver copy reaching past
    // one is pageable (or refused) on a real GPU, and a violation on the simulated driver. The
    // stream splits pieces at chunk ends and merges adjacent pieces only inside one chunk.
    let device = device();
    let chunk = small_host_options().chunk_bytes; // 64 KiB
    let len = 4 * chunk;
    let gpu = device.alloc_gpu(len).unwrap();
    let host = ready_host(&device, len);
    let data: Vec<u8> = (0..len).map(|i| (i * 7 % 253) as u8).collect();
    gpu.write(0, &data).unwrap();
    /// (name, pieces as (offset, length), driver copies merged, driver copies unmerged)
    type Case = (&'static str, Vec<(usize, usize)>, u64, u64);
    let cases: [Case; 3] = [
        // 4 KiB pieces back to back over all four chunks: merged into one copy per chunk.
        (
            "adjacent pages",
            (0..len / 4096).map(|i| (i * 4096, 4096)).collect(),
            4,
            (len / 4096) as u64,
        ),
        // One piece over everything: split at each chunk end.
        ("one piece", vec![(0, len)], 4, 4),
        // A piece straddling the first boundary, then one continuing its second half.
        (
            "a straddler",
            vec![(chunk - 100, 200), (chunk + 100, 50)],
            2,
            3,
        ),
    ];
    for (name, pieces, merged, unmerged) in cases {
        for coalesce in [true, false] {
            let stream = d2h_stream(&device, coalesce);
            host.write(0, &vec![0u8; len]).unwrap();
            let mut t = Transfer::default();
            for &(at, n) in &pieces {
                t.push(gpu.addr() + at as u64, host.addr() + at as u64, n);
            }
            t.keep(gpu.clone());
            t.keep(host.clone());
            stream.submit(t).unwrap().wait().unwrap();
            let mut out = vec![0u8; len];
            host.read(0, &mut out).unwrap();
            for &(at, n) in &pieces {
                assert!(
                    out[at..at + n] == data[at..at + n],
                    "{name}, coalesce {coalesce}"
                );
            }
            let issued = stream.stats().copies_issued;
            let expected = if coalesce { merged } else { unmerged };
            assert_eq!(issued, expected, "{name}, coalesce {coalesce}");
        }
    }
}

#[test]
fn host_regions_become_ready_in_chunks_and_report_how_they_are_pinned() {
    let device = device();
    let len = (1 << 20) + 123;
    let host = device.alloc_host(len, small_host_options()).unwrap();
    assert!(host.wait_ready(len, Duration::from_secs(60)));
    assert_eq!(host.ready_bytes(), len);
    assert!(host.is_fully_ready());
    let (first, full) = host.ready_times();
    assert!(first.unwrap() <= full.unwrap());
    match (device.kind(), host.pin_status()) {
        (DeviceKind::Emulated, PinStatus::Locked) => {}
        (DeviceKind::Emulated, PinStatus::Unpinned(reason)) => {
            assert!(reason.contains("mlock"), "{reason}")
        }
        (DeviceKind::Cuda, PinStatus::Registered) => {}
        (kind, other) => panic!("unexpected pin status {other:?} on {kind:?}"),
    }
    host.write(len - 3, &[1, 2, 3]).unwrap();
    let mut out = [0u8; 3];
    host.read(len - 3, &mut out).unwrap();
    assert_eq!(out, [1, 2, 3]);
    assert!(host.write(len - 2, &[1, 2, 3]).is_err());
    assert!(device.alloc_host(0, small_host_options()).is_err());
    assert!(device.alloc_gpu(0).is_err());
}

#[test]
fn external_gpu_memory_is_used_but_not_owned() {
    let device = device();
    // The engine's tensor: device memory kvbm did not allocate for itself (on CUDA, registering
    // needs a real device allocation; on the emulated device any memory would do).
    let engine_tensor = device.alloc_gpu(8192).unwrap();
    engine_tensor.write(0, &[3u8; 8192]).unwrap();
    let addr = engine_tensor.addr();
    // SAFETY: `engine_tensor` outlives the region and every transfer below.
    let region = unsafe { device.register_gpu(addr, 8192, 0) }.unwrap();
    assert!(region.is_external());
    // SAFETY: the arguments are refused before anything is touched.
    assert!(unsafe { device.register_gpu(addr, 8192, 1) }.is_err());
    let host = ready_host(&device, 8192);
    let stream = device.copy_stream(Direction::DeviceToHost).unwrap();
    let mut t = Transfer::default();
    t.push(region.addr(), host.addr(), 8192);
    t.keep(region.clone());
    t.keep(host.clone());
    stream.submit(t).unwrap().wait().unwrap();
    drop(region);
    drop(stream);
    let mut out = vec![0u8; 8192];
    host.read(0, &mut out).unwrap();
    assert!(out.iter().all(|&b| b == 3));
    // Dropping the registration left the engine's memory alone: still there, still its own.
    engine_tensor.write(0, &[9]).unwrap();
    let mut first = [0u8; 2];
    engine_tensor.read(0, &mut first).unwrap();
    assert_eq!(first, [9, 3]);
}

#[test]
fn a_held_emulated_stream_starts_nothing_until_released() {
    let device = Device::emulated();
    let gpu = device.alloc_gpu(4096).unwrap();
    let host = device
        .alloc_host(4096, kvbm_cuda::HostRegionOptions::default())
        .unwrap();
    assert!(host.wait_ready(host.len(), std::time::Duration::from_secs(60)));
    gpu.write(0, &[7u8; 4096]).unwrap();
    let stream = device.copy_stream(Direction::DeviceToHost).unwrap();
    let hold = stream.hold().unwrap();
    let mut t = kvbm_cuda::Transfer::with_capacity(1);
    t.push(gpu.addr(), host.addr(), 4096);
    t.keep(gpu.clone());
    t.keep(host.clone());
    let done = stream.submit(t).unwrap();
    // Held: the copy cannot have started, so the host side is still zero.
    assert!(!done.poll().unwrap());
    let mut got = [1u8; 4096];
    host.read(0, &mut got).unwrap();
    assert_eq!(got, [0u8; 4096]);
    drop(hold);
    done.wait().unwrap();
    host.read(0, &mut got).unwrap();
    assert_eq!(got, [7u8; 4096]);
}

/// The simulated driver's stream hold, looked up in the `libcuda.so` cudarc loaded (a real
/// driver has no such symbol: None).
type HoldFn = unsafe extern "C" fn(*mut std::ffi::c_void, *mut *mut std::ffi::c_void) -> i32;
type ReleaseFn = unsafe extern "C" fn(*mut std::ffi::c_void) -> i32;

struct SimHooks {
    hold: HoldFn,
    release: ReleaseFn,
}

fn sim_hooks() -> Option<SimHooks> {
    for name in [c"libcuda.so", c"libcuda.so.1"] {
        // SAFETY: RTLD_NOLOAD only finds a library already loaded; dlsym's results are
        // transmuted to the signatures kvbm-cuda-sim exports them with.
        unsafe {
            let lib = libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
            if lib.is_null() {
                continue;
            }
            let hold = libc::dlsym(lib, c"kvbmSimHoldStream".as_ptr());
            let release = libc::dlsym(lib, c"kvbmSimReleaseHold".as_ptr());
            if hold.is_null() || release.is_null() {
                return None;
            }
            return Some(SimHooks {
                hold: std::mem::transmute::<*mut libc::c_void, HoldFn>(hold),
                release: std::mem::transmute::<*mut libc::c_void, ReleaseFn>(release),
            });
        }
    }
    None
}

/// Holds the engine's stream (the simulator's hook), queues on it a write of `len` bytes from
/// `src` to `dst`, and submits `transfer` on `stream` ordered after the engine's stream. Returns
/// whether the transfer finished while the engine's write was still held; by then the hold is
/// released and both the transfer and the engine's write are done.
fn ordered_behind_held_write(
    hooks: &SimHooks,
    engine: &cudarc::driver::CudaStream,
    (dst, src, len): (u64, u64, usize),
    stream: &kvbm_cuda::CopyStream,
    transfer: Transfer,
) -> bool {
    let handle = engine.cu_stream();
    let mut hold = std::ptr::null_mut();
    // SAFETY: the simulator's hook on a live stream of this context.
    assert_eq!(unsafe { (hooks.hold)(handle.cast(), &mut hold) }, 0);
    // SAFETY: both ranges are live device and pinned host memory of `len` bytes (the caller's).
    unsafe { cudarc::driver::sys::cuMemcpyAsync(dst, src, len, handle) }
        .result()
        .unwrap();
    stream.order_after_stream(handle as u64).unwrap();
    let done = stream.submit(transfer).unwrap();
    let early = done.wait_timeout(Duration::from_millis(300)).unwrap();
    // SAFETY: the handle kvbmSimHoldStream wrote, released once.
    assert_eq!(unsafe { (hooks.release)(hold) }, 0);
    done.wait().unwrap();
    engine.synchronize().unwrap();
    early
}

#[test]
fn copies_ordered_after_the_engines_stream_wait_for_its_queued_writes() {
    // vLLM writes the KV blocks on its own stream; a step's offloads are ordered after it on
    // the device (`order_after_stream`) instead of the host synchronising. Here the engine's
    // write of a block is queued behind a hold on the engine's stream when the offload is
    // submitted: the offload must neither finish before it nor read the old bytes.
    let device = device();
    if device.kind() != DeviceKind::Cuda {
        return; // the emulated device has no engine stream: the engine's writes are done
    }
    let Some(hooks) = sim_hooks() else {
        eprintln!("not the simulated driver: a held engine stream cannot be arranged; skipped");
        return;
    };
    // One pinning chunk: the engine's single copy must not cross a registration.
    let len = small_host_options().chunk_bytes;
    let gpu = device.alloc_gpu(len).unwrap();
    gpu.write(0, &vec![0x11; len]).unwrap();
    let mut pattern = vec![0u8; len];
    rand::rngs::StdRng::seed_from_u64(22).fill_bytes(&mut pattern);
    let src = ready_host(&device, len);
    src.write(0, &pattern).unwrap();
    let out = ready_host(&device, len);

    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let engine = ctx.new_stream().unwrap();
    // Before the hold: creating a stream synchronises the context (cudarc's new_stream).
    let d2h = d2h_stream(&device, true);
    let mut t = Transfer::with_capacity(1);
    t.push(gpu.addr(), out.addr(), len);
    t.keep(gpu.clone());
    t.keep(out.clone());
    let early = ordered_behind_held_write(&hooks, &engine, (gpu.addr(), src.addr(), len), &d2h, t);
    // Ordered after the held write: it cannot finish while the engine's stream is held
    // (without the wait it runs at once and copies the old bytes).
    assert!(
        !early,
        "the offload finished before the engine's write it was ordered after"
    );
    let mut got = vec![0u8; len];
    out.read(0, &mut got).unwrap();
    assert!(
        got == pattern,
        "the offload did not copy the engine's write"
    );
}

#[test]
fn loads_ordered_after_the_engines_stream_land_after_its_queued_writes() {
    // vLLM's own offloading orders its loads after the compute stream because writes to the
    // target blocks (zeroing of new blocks, with asynchronous scheduling) may still be queued
    // there. Here the engine's zeroing of a block is held on its stream when kvbm's load into
    // that block is submitted: the block must end up holding the loaded bytes, not zeros.
    let device = device();
    if device.kind() != DeviceKind::Cuda {
        return;
    }
    let Some(hooks) = sim_hooks() else {
        eprintln!("not the simulated driver: a held engine stream cannot be arranged; skipped");
        return;
    };
    let len = small_host_options().chunk_bytes;
    let gpu = device.alloc_gpu(len).unwrap();
    let zeros = ready_host(&device, len);
    zeros.write(0, &vec![0u8; len]).unwrap();
    let mut pattern = vec![0u8; len];
    rand::rngs::StdRng::seed_from_u64(23).fill_bytes(&mut pattern);
    let src = ready_host(&device, len);
    src.write(0, &pattern).unwrap();

    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let engine = ctx.new_stream().unwrap();
    let h2d = device
        .copy_stream_with(
            Direction::HostToDevice,
            StreamOptions {
                coalesce: true,
                batch_copy: true,
            },
        )
        .unwrap();
    let mut t = Transfer::with_capacity(1);
    t.push(src.addr(), gpu.addr(), len);
    t.keep(gpu.clone());
    t.keep(src.clone());
    let early =
        ordered_behind_held_write(&hooks, &engine, (gpu.addr(), zeros.addr(), len), &h2d, t);
    assert!(
        !early,
        "the load finished before the engine's pending write to its block"
    );
    let mut got = vec![0u8; len];
    gpu.read(0, &mut got).unwrap();
    assert!(
        got == pattern,
        "the engine's pending write overwrote the loaded block"
    );
}

#[test]
fn the_engines_later_work_waits_for_copies_it_was_made_to_wait_for() {
    // vLLM frees sliding-window and Mamba blocks of running requests without telling the
    // connector and may overwrite them in the next step; a fenced step makes vLLM's stream
    // wait for kvbm's offloads (`make_stream_wait`). Here the offload is held (it waits for a
    // held stream) when the engine queues its overwrite of the block: the overwrite must not
    // run before the offload read the block.
    let device = device();
    if device.kind() != DeviceKind::Cuda {
        // No engine stream: the caller is told to wait on the host.
        let d2h = d2h_stream(&device, true);
        assert!(!d2h.make_stream_wait(0).unwrap());
        return;
    }
    let Some(hooks) = sim_hooks() else {
        eprintln!("not the simulated driver: a held stream cannot be arranged; skipped");
        return;
    };
    let len = small_host_options().chunk_bytes;
    let gpu = device.alloc_gpu(len).unwrap();
    gpu.write(0, &vec![0x11; len]).unwrap();
    let mut pattern = vec![0u8; len];
    rand::rngs::StdRng::seed_from_u64(24).fill_bytes(&mut pattern);
    let src = ready_host(&device, len);
    src.write(0, &pattern).unwrap();
    let out = ready_host(&device, len);

    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let engine = ctx.new_stream().unwrap();
    let gate = ctx.new_stream().unwrap();
    let d2h = d2h_stream(&device, true);
    let mut hold = std::ptr::null_mut();
    let gate_handle = gate.cu_stream().cast();
    // SAFETY: the simulator's hook on a live stream of this context.
    let held = unsafe { (hooks.hold)(gate_handle, &mut hold) };
    assert_eq!(held, 0);
    d2h.order_after_stream(gate.cu_stream() as u64).unwrap();
    let mut t = Transfer::with_capacity(1);
    t.push(gpu.addr(), out.addr(), len);
    t.keep(gpu.clone());
    t.keep(out.clone());
    let done = d2h.submit(t).unwrap();
    assert!(d2h.make_stream_wait(engine.cu_stream() as u64).unwrap());
    // The engine's next step overwrites the block.
    // SAFETY: both ranges are live device and pinned host memory of `len` bytes.
    unsafe { cudarc::driver::sys::cuMemcpyAsync(gpu.addr(), src.addr(), len, engine.cu_stream()) }
        .result()
        .unwrap();
    let overwritten = engine.record_event(None).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_millis(300);
    let mut early = false;
    while std::time::Instant::now() < deadline {
        if overwritten.try_is_complete().unwrap() {
            early = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // SAFETY: the handle kvbmSimHoldStream wrote, released once.
    assert_eq!(unsafe { (hooks.release)(hold) }, 0);
    done.wait().unwrap();
    engine.synchronize().unwrap();
    assert!(
        !early,
        "the engine's overwrite ran while the offload it must wait for was held"
    );
    let mut got = vec![0u8; len];
    out.read(0, &mut got).unwrap();
    assert!(
        got == vec![0x11; len],
        "the offload read the engine's later write"
    );
    gpu.read(0, &mut got).unwrap();
    assert!(got == pattern, "the engine's write did not land");
}
