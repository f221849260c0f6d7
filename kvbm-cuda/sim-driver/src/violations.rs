//! The violation log: misuse a real GPU would not forgive (or would forgive only slowly and
//! silently), counted and kept, optionally appended to a report file or fatal.
//!
//! Invariants:
//! - Every violation increments the count, whatever else happens to it.
//! - At most [`KEPT_MAX`] messages are kept in memory; the count and the report file see all.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::config::config;

/// Most violation messages kept in memory.
pub const KEPT_MAX: usize = 1024;

static COUNT: AtomicU64 = AtomicU64::new(0);
static KEPT: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Records one violation: counted, kept, reported, and fatal under `KVBM_SIM_STRICT=1`.
pub(crate) fn record(message: String) {
    COUNT.fetch_add(1, Ordering::SeqCst);
    let config = config();
    if let Some(path) = &config.report_path {
        if let Ok(mut file) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = writeln!(file, "{message}");
        }
    }
    if config.strict {
        eprintln!("kvbm-cuda-sim: violation (KVBM_SIM_STRICT=1, aborting): {message}");
        std::process::abort();
    }
    let mut kept = KEPT.lock().unwrap_or_else(|e| e.into_inner());
    if kept.len() < KEPT_MAX {
        kept.push(message);
    }
}

/// Violations seen since the library was loaded.
pub fn count() -> u64 {
    COUNT.load(Ordering::SeqCst)
}

/// The first [`KEPT_MAX`] violation messages.
pub fn messages() -> Vec<String> {
    KEPT.lock().unwrap_or_else(|e| e.into_inner()).clone()
}
