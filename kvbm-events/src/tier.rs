//! Storage tiers and their medium names on the wire.
//!
//! Inside kvbm a tier is always a [`Tier`]; medium strings appear only at the wire edge.

use std::fmt;

/// Where a block's bytes live. Ordered fastest first: `Gpu < Host < Disk`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// GPU memory (Dynamo's G1).
    Gpu,
    /// Pinned host memory (Dynamo's G2).
    Host,
    /// Local disk (Dynamo's G3).
    Disk,
}

/// A medium name that names no local tier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("medium {0:?} names no local tier")]
pub struct TierParseError(pub String);

impl Tier {
    /// Every tier, fastest first.
    pub const ALL: [Tier; 3] = [Tier::Gpu, Tier::Host, Tier::Disk];

    /// The medium name kvbm publishes for this tier (vLLM's current names).
    pub fn medium_name(self) -> &'static str {
        match self {
            Tier::Gpu => "GPU",
            Tier::Host => "CPU_PINNED",
            Tier::Disk => "DISK",
        }
    }

    /// Reads a medium name as published by kvbm, vLLM, SGLang or Dynamo (case-insensitive):
    /// `GPU`/`DEVICE`; `CPU`/`CPU_PINNED`/`CPU_TIER1` (host); `STORAGE`/`DISK`/`NVME` and Dynamo
    /// KVBM's `CPU_TIER2` (disk). Shared or remote pools (`EXTERNAL`, `NETWORK`, `REMOTE`,
    /// `SHARED`) and unknown names are not local tiers and are refused.
    pub fn from_medium_name(name: &str) -> Result<Tier, TierParseError> {
        match name.to_ascii_uppercase().as_str() {
            "GPU" | "DEVICE" => Ok(Tier::Gpu),
            "CPU_PINNED" | "CPU" | "CPU_TIER1" => Ok(Tier::Host),
            "DISK" | "STORAGE" | "NVME" | "CPU_TIER2" => Ok(Tier::Disk),
            _ => Err(TierParseError(name.to_owned())),
        }
    }

    /// Index of the tier in [`Tier::ALL`], for per-tier arrays.
    pub fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Tier::Gpu => "gpu",
            Tier::Host => "host",
            Tier::Disk => "disk",
        })
    }
}
