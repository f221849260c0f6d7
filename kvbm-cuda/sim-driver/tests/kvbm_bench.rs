//! kvbm's own CUDA path on the simulated driver, in subprocesses: the library is installed as
//! `libcuda.so` in a directory put on `LD_LIBRARY_PATH`, and `kvbm-bench` runs with
//! `--device cuda`, under `KVBM_SIM_STRICT=1` (any violation aborts it) and a printed jitter seed.
//! `kvbm-bench` verifies every byte it moved.
//!
//! The test builds what it runs (`cargo build -p kvbm-bench -p kvbm-cuda-sim`, and the probe
//! example) into the target directory it was itself built in, so it needs nothing prepared.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// The directory holding this test's binary's profile outputs (`target/debug`).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/<test binary>
    exe.parent().and_then(Path::parent).unwrap().to_path_buf()
}

/// Builds kvbm-bench, the simulated driver and the probes once; installs the driver as
/// `libcuda.so` in a directory of its own. Returns (kvbm-bench, pageable probe, driver
/// directory); the other probe lies next to the first.
fn built() -> &'static (PathBuf, PathBuf, PathBuf) {
    static BUILT: OnceLock<(PathBuf, PathBuf, PathBuf)> = OnceLock::new();
    BUILT.get_or_init(|| {
        let profile = profile_dir();
        let target = profile.parent().unwrap();
        let release = profile.file_name().is_some_and(|n| n == "release");
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        for args in [
            &["build", "-p", "kvbm-bench", "-p", "kvbm-cuda-sim"][..],
            &[
                "build",
                "-p",
                "kvbm-cuda-sim",
                "--example",
                "pageable_probe",
                "--example",
                "lost_context_probe",
            ][..],
        ] {
            let mut cmd = Command::new(env!("CARGO"));
            cmd.args(args).arg("--target-dir").arg(target);
            if release {
                cmd.arg("--release");
            }
            let status = cmd.current_dir(&workspace).status().unwrap();
            assert!(status.success(), "cargo {args:?} failed");
        }
        // One directory per test process; those of processes that are gone are removed.
        let drivers = target.join("kvbm-cuda-sim");
        for entry in std::fs::read_dir(&drivers).into_iter().flatten().flatten() {
            let pid = entry.file_name();
            if !Path::new("/proc").join(&pid).exists() {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        let driver_dir = drivers.join(std::process::id().to_string());
        kvbm_cuda_sim::install(&profile.join("libkvbm_cuda_sim.so"), &driver_dir).unwrap();
        (
            profile.join("kvbm-bench"),
            profile.join("examples/pageable_probe"),
            driver_dir,
        )
    })
}

/// Longest a child process may run before the test kills it and fails: a hang is a failure.
const CHILD_SECS_MAX: u64 = 300;

/// Runs `cmd` to completion, or kills it after `secs_max` and fails.
fn output_within(mut cmd: Command, secs_max: u64) -> Output {
    use std::process::Stdio;
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Drain the pipes on threads so that a chatty child never blocks on a full pipe.
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out_reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        std::io::Read::read_to_end(&mut stdout, &mut buf).map(|_| buf)
    });
    let err_reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        std::io::Read::read_to_end(&mut stderr, &mut buf).map(|_| buf)
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs_max);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} ran past {secs_max} s (a hang on the simulated driver?)");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    Output {
        status,
        stdout: out_reader.join().unwrap().unwrap(),
        stderr: err_reader.join().unwrap().unwrap(),
    }
}

/// Runs `program args` with the simulated driver (strict or not, with `extra` variables), with
/// jitter from a printed seed.
fn run_on_sim(
    program: &Path,
    args: &[&str],
    strict: bool,
    report: Option<&Path>,
    extra: &[(&str, &str)],
) -> Output {
    let (_, _, driver_dir) = built();
    let seed: u64 = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos()
        .into();
    println!(
        "{} {args:?}: KVBM_SIM_JITTER_SEED={seed}",
        program.display()
    );
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env("LD_LIBRARY_PATH", driver_dir)
        .env("KVBM_SIM_JITTER_SEED", seed.to_string())
        .env("KVBM_SIM_JITTER_US", "20")
        .env_remove("KVBM_SIM_REPORT")
        .env_remove("KVBM_SIM_STRICT")
        .env_remove("KVBM_SIM_FAIL")
        .envs(extra.iter().copied());
    if strict {
        cmd.env("KVBM_SIM_STRICT", "1");
    }
    if let Some(report) = report {
        cmd.env("KVBM_SIM_REPORT", report);
    }
    let out = output_within(cmd, CHILD_SECS_MAX);
    println!("stdout:\n{}", String::from_utf8_lossy(&out.stdout));
    println!("stderr:\n{}", String::from_utf8_lossy(&out.stderr));
    out
}

fn check_bench(args: &[&str], verified: &str) {
    let (bench, _, _) = built();
    let out = run_on_sim(bench, args, true, None, &[]);
    assert!(
        out.status.success(),
        "kvbm-bench {args:?} failed: {:?}",
        out.status
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("cuda"),
        "kvbm-bench did not run on the CUDA back end"
    );
    assert!(stdout.contains(verified), "no `{verified}` in the output");
}

#[test]
fn kvbm_bench_copy_runs_byte_exact_on_the_cuda_back_end() {
    // Every layout shape: many pieces per block (lbnhc), one (blnhc), per-layer halves
    // (outer-first); batched copies, then piece by piece.
    for layout in ["lbnhc", "blnhc", "outer-first"] {
        let args = [
            "copy",
            "--device",
            "cuda",
            "--gib",
            "0.01",
            "--iterations",
            "1",
            "--layers",
            "4",
            "--layout",
            layout,
        ];
        check_bench(&args, "every byte verified");
    }
}

#[test]
fn kvbm_bench_offload_runs_byte_exact_on_both_engines_and_the_disk_tier() {
    for engine in ["split", "manager"] {
        let args = [
            "offload",
            "--device",
            "cuda",
            "--blocks",
            "32",
            "--layers",
            "4",
            "--host-gb",
            "0.02",
            "--iterations",
            "1",
            "--engine",
            engine,
        ];
        check_bench(&args, "verified: every byte of every block");
    }
    // With the disk tier: back from disk asynchronously, as the connector onboards.
    let disk_dir = built().2.join("disk");
    let disk_dir = disk_dir.to_str().unwrap();
    let args = [
        "offload",
        "--device",
        "cuda",
        "--blocks",
        "32",
        "--layers",
        "4",
        "--host-gb",
        "0.02",
        "--iterations",
        "1",
        "--disk-gb",
        "0.02",
        "--disk-dir",
        disk_dir,
    ];
    check_bench(&args, "verified: every byte of every block");
}

#[test]
fn a_violation_is_counted_reported_and_fatal_when_strict() {
    let (_, probe, driver_dir) = built();
    let report = driver_dir.join("report.txt");
    let _ = std::fs::remove_file(&report);
    let out = run_on_sim(probe, &[], false, Some(&report), &[]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("violations 1"));
    let reported = std::fs::read_to_string(&report).unwrap();
    assert!(reported.contains("pageable host memory"), "{reported}");

    let out = run_on_sim(probe, &[], true, None, &[]);
    assert!(
        !out.status.success(),
        "strict mode did not stop the process"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("KVBM_SIM_STRICT=1, aborting"));
}

const SMALL_COPY: &[&str] = &[
    "copy",
    "--device",
    "cuda",
    "--gib",
    "0.01",
    "--iterations",
    "1",
    "--layers",
    "4",
];

#[test]
fn injected_driver_failures_surface_as_errors_or_fallbacks_never_panics() {
    let (bench, _, _) = built();
    // A failed allocation: kvbm-bench stops with the driver's error named.
    let out = run_on_sim(
        bench,
        SMALL_COPY,
        true,
        None,
        &[("KVBM_SIM_FAIL", "alloc:1:2")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("cuMemAlloc") && stderr.contains("CUDA_ERROR_OUT_OF_MEMORY"));
    assert!(!stderr.contains("panicked"), "{stderr}");
    // A refused batched copy: kvbm-cuda copies piece by piece instead, every byte still right.
    let out = run_on_sim(
        bench,
        SMALL_COPY,
        true,
        None,
        &[("KVBM_SIM_FAIL", "batch:2:700")],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(stdout.contains("batch copy false") && stdout.contains("every byte verified"));
    // A refused cuMemcpyAsync (copies piece by piece): the transfer fails with the call named.
    let out = run_on_sim(
        bench,
        SMALL_COPY,
        true,
        None,
        &[("KVBM_SIM_FAIL", "memcpy:3:700"), ("KVBM_COPY_BATCH", "0")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("cuMemcpyAsync") && stderr.contains("CUDA_ERROR_ILLEGAL_ADDRESS"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    // A refused host registration: kvbm-cuda serves that chunk unpinned (logged), which a GPU
    // copies correctly but synchronously; the simulator counts each such copy as pageable, and
    // nothing else.
    let dir = tempfile_dir("register-fault");
    let report = dir.join("violations.txt");
    let out = run_on_sim(
        bench,
        SMALL_COPY,
        false,
        Some(&report),
        &[("KVBM_SIM_FAIL", "register:1:2")],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("every byte verified"), "{stdout}");
    assert!(stderr.contains("serving it unpinned"), "{stderr}");
    let violations = std::fs::read_to_string(&report).unwrap();
    let pageable = violations.matches("is pageable host memory").count();
    assert!(pageable > 0, "{violations}");
    assert!(
        violations
            .lines()
            .filter(|l| l.starts_with("cuMemcpy"))
            .all(|l| l.contains("is pageable host memory")),
        "{violations}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A fresh directory under the target directory for one test of this process.
fn tempfile_dir(name: &str) -> PathBuf {
    let (_, _, driver_dir) = built();
    let dir = driver_dir.join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn a_copy_that_fails_on_its_stream_fails_the_run_without_a_hang_or_a_panic() {
    // The second copy operation a stream runs faults as a DMA error would: the call that queued
    // it succeeded, the event reports it, and the context is lost for every later call.
    let (bench, _, _) = built();
    let offload = [
        "offload",
        "--device",
        "cuda",
        "--blocks",
        "32",
        "--layers",
        "4",
        "--host-gb",
        "0.02",
        "--iterations",
        "1",
        "--engine",
        "split",
    ];
    for args in [SMALL_COPY, &offload[..]] {
        let out = run_on_sim(bench, args, true, None, &[("KVBM_SIM_FAIL", "async:2:700")]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "{args:?} succeeded over a failed copy"
        );
        assert!(
            stderr.contains("CUDA_ERROR_ILLEGAL_ADDRESS"),
            "{:?}: {stderr}",
            out.status
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn nothing_runs_on_a_lost_context_so_memory_released_after_a_fault_is_safe() {
    // kvbm-cuda releases a transfer's regions once its completion reports a fault, with copies
    // of other streams still queued. The simulator once went on poisoning their targets under
    // jitter, and segfaulted into a host range already unmapped (seen in CI as a kvbm-bench run
    // killed halfway through printing its error). The probe replays that order in one process.
    let (_, pageable, _) = built();
    let probe = pageable.with_file_name("lost_context_probe");
    let out = run_on_sim(
        &probe,
        &[],
        true,
        None,
        &[
            ("KVBM_SIM_FAIL", "async:1:700"),
            ("KVBM_SIM_JITTER_US", "50"),
        ],
    );
    assert!(out.status.success(), "{:?}", out.status);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "survived");
}

#[test]
fn on_a_driver_without_batched_copies_kvbm_copies_piece_by_piece() {
    // A driver older than CUDA 12.8 has no cuMemcpyBatchAsync: the simulated driver built with
    // `old-driver` leaves it out, and kvbm-cuda must see that when it opens the driver.
    let (bench, _, driver_dir) = built();
    let profile = profile_dir();
    let target = profile.parent().unwrap();
    let release = profile.file_name().is_some_and(|n| n == "release");
    let old_target = target.join("kvbm-cuda-sim-old-driver");
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args([
        "build",
        "-p",
        "kvbm-cuda-sim",
        "--features",
        "old-driver",
        "--lib",
    ])
    .arg("--target-dir")
    .arg(&old_target);
    if release {
        cmd.arg("--release");
    }
    assert!(cmd.current_dir(&workspace).status().unwrap().success());
    // Inside this process's own driver directory, which only this process removes.
    let old_dir = driver_dir.join("old-driver");
    let built_lib = old_target
        .join(profile.file_name().unwrap())
        .join("libkvbm_cuda_sim.so");
    kvbm_cuda_sim::install(&built_lib, &old_dir).unwrap();
    let out = Command::new(bench)
        .args(SMALL_COPY)
        .env("LD_LIBRARY_PATH", &old_dir)
        .env("KVBM_SIM_STRICT", "1")
        .env("KVBM_SIM_JITTER_SEED", "3")
        .env("KVBM_SIM_JITTER_US", "20")
        .env_remove("KVBM_SIM_FAIL")
        .env_remove("KVBM_SIM_REPORT")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let _ = std::fs::remove_dir_all(&old_dir);
    assert!(
        out.status.success(),
        "{:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("batch copy false") && stdout.contains("every byte verified"),
        "{stdout}"
    );
    // The same program on the full driver batches.
    let out = run_on_sim(bench, SMALL_COPY, true, None, &[]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("batch copy true"));
}
