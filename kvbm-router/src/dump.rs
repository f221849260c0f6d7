//! The index as a sibling router reads it: `GET /dump` streams it as NDJSON, and
//! `--bootstrap-from URL` reads it at start, so that a new or restarted replica recovers without
//! a broker and then catches up on each worker's stream from the sequence number after the one
//! the dump was taken at.
//!
//! Lines, in order (every number is exact: JSON integers up to u64):
//! `{"kind":"header","format":"kvbm-router-dump","version":1,"block_size":N}`, then per worker
//! `{"kind":"worker","worker_id","dp_rank","endpoint","replay_endpoint","last_seq"}` followed by
//! its engine hashes `{"kind":"name","engine","ours","namespace","refs"}` and holdings
//! `{"kind":"hold","tier":"GPU"|"CPU_PINNED"|"DISK","hash","count"}`, and a final
//! `{"kind":"end","workers":N}`. A dump without its end line is incomplete and refused.
//!
//! Invariants: a worker's part is consistent with its `last_seq` (taken under the lock the event
//! pump applies batches under); reading never trusts the input's sizes (lines are bounded, every
//! worker's holdings are bounded by the reader's `--max-blocks-per-worker`), and a dump of another
//! block size is refused.

use std::io::{BufRead, Write};
use std::time::Duration;

use kvbm_events::router::{Holding, NameEntry, WorkerSnapshot};
use kvbm_events::Tier;
use serde::{Deserialize, Serialize};

/// The format's name and version.
pub const FORMAT: &str = "kvbm-router-dump";
/// The version written and read.
pub const VERSION: u32 = 1;
/// Longest line read.
pub const LINE_BYTES_MAX: usize = 64 << 10;

/// A worker as a dump records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DumpWorker {
    /// Worker id.
    pub worker_id: u64,
    /// Data-parallel rank.
    pub dp_rank: u32,
    /// Its KV events endpoint.
    pub endpoint: String,
    /// Its replay endpoint.
    pub replay_endpoint: Option<String>,
    /// The last sequence number applied, if any.
    pub last_seq: Option<u64>,
}

/// A whole dump.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dump {
    /// Tokens per block of the router that wrote it.
    pub block_size: usize,
    /// Every worker with its index state.
    pub workers: Vec<(DumpWorker, WorkerSnapshot)>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
enum Line {
    Header {
        format: String,
        version: u32,
        block_size: usize,
    },
    Worker(DumpWorker),
    Name {
        engine: u64,
        ours: u64,
        namespace: u64,
        refs: u32,
    },
    Hold {
        tier: String,
        hash: u64,
        count: u32,
    },
    End {
        workers: usize,
    },
}

fn line(out: &mut impl Write, l: &Line) -> std::io::Result<()> {
    serde_json::to_writer(&mut *out, l)?;
    out.write_all(b"\n")
}

/// Writes `dump` as NDJSON.
pub fn write(dump: &Dump, out: &mut impl Write) -> std::io::Result<()> {
    line(
        out,
        &Line::Header {
            format: FORMAT.into(),
            version: VERSION,
            block_size: dump.block_size,
        },
    )?;
    for (w, snap) in &dump.workers {
        line(out, &Line::Worker(w.clone()))?;
        for n in &snap.names {
            line(
                out,
                &Line::Name {
                    engine: n.engine,
                    ours: n.ours,
                    namespace: n.namespace,
                    refs: n.refs,
                },
            )?;
        }
        for h in &snap.holdings {
            line(
                out,
                &Line::Hold {
                    tier: h.tier.medium_name().into(),
                    hash: h.hash,
                    count: h.count,
                },
            )?;
        }
    }
    line(
        out,
        &Line::End {
            workers: dump.workers.len(),
        },
    )
}

/// Reads a dump written by [`write`] for a router of `block_size`, allowing each worker at most
/// `holdings_max` holdings and as many engine hashes.
pub fn read(input: impl BufRead, block_size: usize, holdings_max: usize) -> Result<Dump, String> {
    let mut dump = Dump::default();
    let mut header = false;
    let mut ended = false;
    let mut buf = Vec::new();
    let mut input = input;
    for number in 1.. {
        buf.clear();
        // Bounded read of one line.
        let n = std::io::Read::take(&mut input, LINE_BYTES_MAX as u64 + 1)
            .read_until(b'\n', &mut buf)
            .map_err(|e| format!("reading line {number}: {e}"))?;
        if n == 0 {
            break;
        }
        if buf.len() > LINE_BYTES_MAX {
            return Err(format!(
                "line {number} is longer than {LINE_BYTES_MAX} bytes"
            ));
        }
        if ended {
            return Err(format!("line {number} follows the end line"));
        }
        let l: Line = serde_json::from_slice(&buf).map_err(|e| format!("line {number}: {e}"))?;
        match l {
            Line::Header {
                format,
                version,
                block_size: bs,
            } => {
                if header || format != FORMAT || version != VERSION {
                    return Err(format!(
                        "line {number}: not a {FORMAT} version {VERSION} header"
                    ));
                }
                if bs != block_size {
                    return Err(format!(
                        "the dump is of blocks of {bs} tokens; this router's are {block_size}"
                    ));
                }
                dump.block_size = bs;
                header = true;
            }
            _ if !header => return Err("the dump does not start with its header".into()),
            Line::Worker(w) => {
                let key = (w.worker_id, w.dp_rank);
                if dump
                    .workers
                    .iter()
                    .any(|(o, _)| (o.worker_id, o.dp_rank) == key)
                {
                    return Err(format!("worker {}:{} appears twice", key.0, key.1));
                }
                dump.workers.push((
                    w,
                    WorkerSnapshot {
                        worker: key,
                        ..Default::default()
                    },
                ));
            }
            Line::Name {
                engine,
                ours,
                namespace,
                refs,
            } => {
                let (_, snap) = dump
                    .workers
                    .last_mut()
                    .ok_or_else(|| format!("line {number}: a name before any worker"))?;
                if snap.names.len() >= holdings_max {
                    return Err(format!("line {number}: more than {holdings_max} names"));
                }
                snap.names.push(NameEntry {
                    engine,
                    ours,
                    namespace,
                    refs,
                });
            }
            Line::Hold { tier, hash, count } => {
                let (_, snap) = dump
                    .workers
                    .last_mut()
                    .ok_or_else(|| format!("line {number}: a holding before any worker"))?;
                if snap.holdings.len() >= holdings_max {
                    return Err(format!("line {number}: more than {holdings_max} holdings"));
                }
                let tier = Tier::from_medium_name(&tier)
                    .map_err(|_| format!("line {number}: unknown tier {tier:?}"))?;
                snap.holdings.push(Holding { tier, hash, count });
            }
            Line::End { workers } => {
                if workers != dump.workers.len() {
                    return Err(format!(
                        "the end line counts {workers} workers; the dump has {}",
                        dump.workers.len()
                    ));
                }
                ended = true;
            }
        }
    }
    if !ended {
        return Err("the dump ends without its end line (incomplete)".into());
    }
    Ok(dump)
}

/// Fetches `url`'s dump (`URL/dump`), for a router of `block_size`.
pub fn fetch(
    url: &str,
    block_size: usize,
    holdings_max: usize,
    timeout: Duration,
) -> Result<Dump, String> {
    let url = format!("{}/dump", url.trim_end_matches('/'));
    let response = ureq::get(&url)
        .timeout(timeout)
        .call()
        .map_err(|e| format!("GET {url}: {e}"))?;
    read(
        std::io::BufReader::new(response.into_reader()),
        block_size,
        holdings_max,
    )
    .map_err(|e| format!("{url}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Dump {
        Dump {
            block_size: 16,
            workers: vec![(
                DumpWorker {
                    worker_id: 7,
                    dp_rank: 1,
                    endpoint: "tcp://127.0.0.1:5557".into(),
                    replay_endpoint: Some("tcp://127.0.0.1:5558".into()),
                    last_seq: Some(u64::MAX - 1),
                },
                WorkerSnapshot {
                    worker: (7, 1),
                    names: vec![NameEntry {
                        engine: u64::MAX,
                        ours: 3,
                        namespace: 0,
                        refs: 2,
                    }],
                    holdings: vec![
                        Holding {
                            tier: Tier::Gpu,
                            hash: 3,
                            count: 1,
                        },
                        Holding {
                            tier: Tier::Disk,
                            hash: 3,
                            count: 1,
                        },
                    ],
                },
            )],
        }
    }

    #[test]
    fn dumps_round_trip_and_bad_ones_are_refused() {
        let mut bytes = Vec::new();
        write(&sample(), &mut bytes).unwrap();
        assert_eq!(read(&bytes[..], 16, 100).unwrap(), sample());
        // Another block size, a cut dump, a dump over the limits, garbage.
        assert!(read(&bytes[..], 32, 100).unwrap_err().contains("16 tokens"));
        let cut = &bytes[..bytes.len() - 20];
        assert!(read(cut, 16, 100).is_err());
        assert!(read(&bytes[..], 16, 1).unwrap_err().contains("more than 1"));
        assert!(read(&b"{\"kind\":\"end\",\"workers\":0}\n"[..], 16, 10).is_err());
        let long = vec![b'x'; LINE_BYTES_MAX + 10];
        assert!(read(&long[..], 16, 10).unwrap_err().contains("longer"));
    }
}
