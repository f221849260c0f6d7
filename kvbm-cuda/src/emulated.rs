//! The emulated copy stream: one worker thread per stream running memcpy, transfers in order.
//!
//! A stream can be *held* ([`EmulatedStream::hold`]): while a hold lives, the worker starts no
//! further transfer, so tests can keep a copy in flight for as long as they need, without
//! timing, and check what the code above does meanwhile. It can also be told to fail its next
//! transfers ([`EmulatedStream::fail_next`]): each completes with a driver error and copies no
//! byte, as a DMA fault would, so that tests can follow a failed copy through every layer.

use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use parking_lot::{Condvar, Mutex};

use crate::region::Region;
use crate::stream::{CopyPiece, Direction, Signal, STREAM_QUEUE_MAX};
use crate::DeviceError;

struct Job {
    pieces: Vec<CopyPiece>,
    /// Held until the copy is done: the worker is the one that observes completion.
    regions: Vec<Region>,
    signal: Arc<Signal>,
}

/// Holds alive, and the worker's wait for them to end.
type Holds = Arc<(Mutex<usize>, Condvar)>;

pub(crate) struct EmulatedStream {
    sender: Option<Sender<Job>>,
    worker: Option<JoinHandle<()>>,
    holds: Holds,
    /// Transfers still to fail, from the next one the worker starts.
    failing: Arc<std::sync::atomic::AtomicUsize>,
}

/// Keeps an emulated stream from starting transfers until dropped.
#[must_use = "the stream runs again as soon as the hold is dropped"]
pub struct StreamHold {
    holds: Holds,
}

impl std::fmt::Debug for StreamHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StreamHold")
    }
}

impl Drop for StreamHold {
    fn drop(&mut self) {
        let (count, cv) = &*self.holds;
        *count.lock() -= 1;
        cv.notify_all();
    }
}

impl EmulatedStream {
    pub(crate) fn new(direction: Direction) -> Result<Self, DeviceError> {
        let (sender, receiver) = crossbeam_channel::bounded(STREAM_QUEUE_MAX);
        let holds: Holds = Arc::default();
        let worker_holds = holds.clone();
        let failing = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let worker_failing = failing.clone();
        let worker = std::thread::Builder::new()
            .name(format!("kvbm-emu-{}", direction.as_str()))
            .spawn(move || run(receiver, worker_holds, &worker_failing))
            .map_err(|e| DeviceError::Os {
                call: "spawn",
                errno: nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(0)),
            })?;
        Ok(Self {
            sender: Some(sender),
            worker: Some(worker),
            holds,
            failing,
        })
    }

    /// Fails the next `n` transfers the worker starts (each copies nothing and completes with a
    /// driver error).
    pub(crate) fn fail_next(&self, n: usize) {
        self.failing
            .fetch_add(n, std::sync::atomic::Ordering::SeqCst);
    }

    /// Stops the worker before its next transfer until the hold drops (a transfer already
    /// running finishes).
    pub(crate) fn hold(&self) -> StreamHold {
        *self.holds.0.lock() += 1;
        StreamHold {
            holds: self.holds.clone(),
        }
    }

    /// Queues a validated transfer; waits when [`STREAM_QUEUE_MAX`] transfers are queued.
    pub(crate) fn submit(
        &self,
        pieces: Vec<CopyPiece>,
        regions: Vec<Region>,
    ) -> Result<Arc<Signal>, DeviceError> {
        let signal = Arc::new(Signal::default());
        let job = Job {
            pieces,
            regions,
            signal: signal.clone(),
        };
        self.sender
            .as_ref()
            .ok_or(DeviceError::StreamClosed)?
            .send(job)
            .map_err(|_| DeviceError::StreamClosed)?;
        Ok(signal)
    }
}

fn run(receiver: Receiver<Job>, holds: Holds, failing: &std::sync::atomic::AtomicUsize) {
    use std::sync::atomic::Ordering;
    for job in receiver {
        {
            let (count, cv) = &*holds;
            let mut held = count.lock();
            while *held > 0 {
                cv.wait(&mut held);
            }
        }
        let fail = failing
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if fail {
            job.signal.set(Err(DeviceError::Driver {
                call: "emulated copy",
                code: "an injected fault".into(),
            }));
            drop(job.regions);
            continue;
        }
        for p in &job.pieces {
            // SAFETY: `validate` checked that both ranges lie inside regions of this transfer,
            // which `job.regions` keeps alive until after the copy; source and target are
            // distinct mappings, so the ranges do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(p.src as *const u8, p.dst as *mut u8, p.len) };
        }
        job.signal.set(Ok(()));
        drop(job.regions);
    }
}

impl Drop for EmulatedStream {
    fn drop(&mut self) {
        // Closing the channel lets the worker finish every queued transfer, then exit.
        drop(self.sender.take());
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}
