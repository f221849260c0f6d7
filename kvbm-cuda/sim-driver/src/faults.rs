//! Fault injection: `KVBM_SIM_FAIL=KIND:N:CODE[,KIND:N:CODE...]` fails the Nth call (from 1) of
//! a kind of driver call with the given `CUresult`, before the call does anything. Kinds:
//! `alloc` (`cuMemAlloc`), `register` (`cuMemHostRegister`), `memcpy` (`cuMemcpyAsync`),
//! `batch` (`cuMemcpyBatchAsync`), and `async`: the Nth copy operation a stream runs fails as a
//! DMA fault does, after its call succeeded: nothing of it is copied, and the error is sticky,
//! returned by every later call that needs the context (the context is lost, as on a GPU).
//!
//! Invariants:
//! - Calls are counted per kind from library load, whether they fail or not; a fault fires once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use crate::result::CUresult;

/// The variable naming the faults.
pub const FAIL_ENV: &str = "KVBM_SIM_FAIL";

/// A kind of driver call faults can be injected into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `cuMemAlloc`.
    Alloc,
    /// `cuMemHostRegister`.
    Register,
    /// `cuMemcpyAsync`.
    Memcpy,
    /// `cuMemcpyBatchAsync`.
    Batch,
    /// A copy operation run by a stream (one `cuMemcpyAsync` or one whole batch).
    Async,
}

const KINDS: [(Kind, &str); 5] = [
    (Kind::Alloc, "alloc"),
    (Kind::Register, "register"),
    (Kind::Memcpy, "memcpy"),
    (Kind::Batch, "batch"),
    (Kind::Async, "async"),
];

/// One fault: the `nth` call of `kind` fails with `code`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// The kind of call.
    pub kind: Kind,
    /// Which call, from 1.
    pub nth: u64,
    /// The result it returns.
    pub code: CUresult,
}

/// Parses `KIND:N:CODE[,...]`; the error names the part that does not parse.
pub fn parse(spec: &str) -> Result<Vec<Fault>, String> {
    spec.split(',')
        .filter(|part| !part.trim().is_empty())
        .map(|part| {
            let fields: Vec<&str> = part.trim().split(':').collect();
            let [kind, nth, code] = fields[..] else {
                return Err(format!("{part:?}: expected KIND:N:CODE"));
            };
            let kind = KINDS
                .iter()
                .find(|(_, name)| *name == kind)
                .map(|&(k, _)| k)
                .ok_or_else(|| {
                    format!("{part:?}: kind is one of alloc, register, memcpy, batch, async")
                })?;
            let nth = nth
                .parse::<u64>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("{part:?}: N counts calls from 1"))?;
            let code = code
                .parse::<CUresult>()
                .ok()
                .filter(|&c| c != 0)
                .ok_or_else(|| format!("{part:?}: CODE is a non-zero CUresult number"))?;
            Ok(Fault { kind, nth, code })
        })
        .collect()
}

fn faults() -> &'static [Fault] {
    static FAULTS: OnceLock<Vec<Fault>> = OnceLock::new();
    FAULTS.get_or_init(|| match std::env::var(FAIL_ENV) {
        Err(_) => Vec::new(),
        Ok(spec) => parse(&spec).unwrap_or_else(|e| {
            eprintln!("kvbm-cuda-sim: {FAIL_ENV}: {e}");
            std::process::abort();
        }),
    })
}

static CALLS: [AtomicU64; KINDS.len()] = [const { AtomicU64::new(0) }; KINDS.len()];

/// Counts one call of `kind`; `Err(code)` when a fault is set for this call.
pub(crate) fn check(kind: Kind) -> Result<(), CUresult> {
    let index = KINDS.iter().position(|(k, _)| *k == kind).unwrap_or(0);
    let nth = CALLS[index].fetch_add(1, Ordering::SeqCst) + 1;
    match faults().iter().find(|f| f.kind == kind && f.nth == nth) {
        Some(f) => Err(f.code),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_lists_parse_and_nonsense_is_named() {
        let cases: &[(&str, Result<Vec<Fault>, &str>)] = &[
            ("", Ok(vec![])),
            (
                "alloc:2:2, memcpy:5:700",
                Ok(vec![
                    Fault {
                        kind: Kind::Alloc,
                        nth: 2,
                        code: 2,
                    },
                    Fault {
                        kind: Kind::Memcpy,
                        nth: 5,
                        code: 700,
                    },
                ]),
            ),
            ("alloc:0:2", Err("counts calls from 1")),
            ("free:1:2", Err("kind is one of")),
            ("batch:1:0", Err("non-zero CUresult")),
            ("batch:1", Err("expected KIND:N:CODE")),
        ];
        for (spec, expected) in cases {
            match (parse(spec), expected) {
                (Ok(got), Ok(want)) => assert_eq!(&got, want, "{spec}"),
                (Err(got), Err(want)) => assert!(got.contains(want), "{spec}: {got}"),
                (got, want) => panic!("{spec}: got {got:?}, expected {want:?}"),
            }
        }
    }
}
