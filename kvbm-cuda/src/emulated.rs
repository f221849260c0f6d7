//! The emulated copy stream: one worker thread per stream running memcpy, transfers in order.

use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

use crate::region::Region;
use crate::stream::{CopyPiece, Direction, Signal, STREAM_QUEUE_MAX};
use crate::DeviceError;

struct Job {
    pieces: Vec<CopyPiece>,
    /// Held until the copy is done: the worker is the one that observes completion.
    regions: Vec<Region>,
    signal: Arc<Signal>,
}

pub(crate) struct EmulatedStream {
    sender: Option<Sender<Job>>,
    worker: Option<JoinHandle<()>>,
}

impl EmulatedStream {
    pub(crate) fn new(direction: Direction) -> Result<Self, DeviceError> {
        let (sender, receiver) = crossbeam_channel::bounded(STREAM_QUEUE_MAX);
        let worker = std::thread::Builder::new()
            .name(format!("kvbm-emu-{}", direction.as_str()))
            .spawn(move || run(receiver))
            .map_err(|e| DeviceError::Os {
                call: "spawn",
                errno: nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(0)),
            })?;
        Ok(Self {
            sender: Some(sender),
            worker: Some(worker),
        })
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

fn run(receiver: Receiver<Job>) {
    for job in receiver {
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
