//! `kvbm-disk-inspect`: reports what kvbm would recover from a disk cache, changing nothing.
//!
//! Usage: `kvbm-disk-inspect DIR NAME FINGERPRINT PAYLOAD_BYTES SLOTS [--hold] [--write]`
//!
//! Prints one line: `layout_matches=<bool> from_checkpoint=<bool> blocks=<n>
//! engine=<io_uring|psync> io_mode=<Direct|Buffered>`, or `error: ...` (exit 1). By default the
//! cache is opened read-only under a shared lock: nothing is created, sized, re-initialised or
//! checkpointed. `--write` opens it as kvbm does instead (a file of another layout is
//! re-initialised, the checkpoint consumed and rewritten on close). With `--hold` it keeps the
//! file open (and locked) until its standard input closes.

use std::io::Read;
use std::path::PathBuf;

use kvbm_disk::{DiskStore, EngineChoice, StoreOptions, SLOT_PAYLOAD_BYTES_MAX};

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let hold = args.iter().any(|a| a == "--hold");
    let write = args.iter().any(|a| a == "--write");
    let positional: Vec<&String> = args.iter().filter(|a| !a.starts_with("--")).collect();
    let parsed = (|| -> Result<_, String> {
        let [dir, name, fingerprint, payload, slots] = positional.as_slice() else {
            return Err(
                "usage: kvbm-disk-inspect DIR NAME FINGERPRINT PAYLOAD_BYTES SLOTS [--hold] [--write]"
                    .into(),
            );
        };
        let number = |what: &str, v: &str| {
            v.parse::<u64>()
                .map_err(|_| format!("{what} {v:?} is not a number"))
        };
        // Bounded by the format: a slot's payload moves in one I/O, block ids are 32-bit.
        let bounded = |what: &str, v: &str, max: usize| {
            let n = number(what, v)?;
            usize::try_from(n)
                .ok()
                .filter(|&n| (1..=max).contains(&n))
                .ok_or_else(|| format!("{what} {v:?}: must be between 1 and {max}"))
        };
        Ok((
            PathBuf::from(dir),
            name.to_string(),
            number("FINGERPRINT", fingerprint)?,
            bounded("PAYLOAD_BYTES", payload, SLOT_PAYLOAD_BYTES_MAX)?,
            bounded("SLOTS", slots, u32::MAX as usize)?,
        ))
    })();
    let (dir, name, fingerprint, payload_bytes, slots) = match parsed {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{e}");
            return std::process::ExitCode::from(2);
        }
    };
    let options = StoreOptions {
        layout_fingerprint: fingerprint,
        payload_bytes,
        slots,
        queue_depth: 8,
        engine: EngineChoice::Auto,
        file: Default::default(),
        write_failures_max: 8,
    };
    let opened = if write {
        DiskStore::open(&dir, &name, options)
    } else {
        DiskStore::inspect(&dir, &name, options)
    };
    match opened {
        Ok((store, recovered)) => {
            println!(
                "layout_matches={} from_checkpoint={} blocks={} engine={} io_mode={:?}",
                !recovered.initialised,
                recovered.from_checkpoint,
                recovered.blocks.len(),
                store.engine().kind().as_str(),
                store.file().io_mode()
            );
            if hold {
                let _ = std::io::stdin().read_to_end(&mut Vec::new());
            }
            match store.close() {
                Ok(()) => std::process::ExitCode::SUCCESS,
                Err(e) => {
                    println!("error: {e}");
                    std::process::ExitCode::from(1)
                }
            }
        }
        Err(e) => {
            println!("error: {e}");
            std::process::ExitCode::from(1)
        }
    }
}
