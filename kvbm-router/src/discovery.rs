//! Workers from a file (`--workers-file`): one worker per line in the `--workers` syntax (blank
//! lines and `#` comments ignored), re-read when it changes. A worker that appears is registered,
//! one whose line changed is registered again (its state is dropped), one that disappears is
//! unregistered. Workers registered otherwise (`--workers`, `POST /register`) are not touched.
//!
//! A file that does not parse is reported in the log and leaves the registered workers as they
//! were; one bad line fails the whole file, so that a half-edited file never unregisters half the
//! fleet.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::config::{parse_worker, ConfigError, WorkerSpec};
use crate::state::Router;
use kvbm_events::router::WorkerKey;

/// Largest workers file read, in bytes.
pub const WORKERS_FILE_BYTES_MAX: u64 = 1 << 20;

/// Parses a workers file's text.
pub fn parse_workers_file(text: &str) -> Result<BTreeMap<WorkerKey, WorkerSpec>, ConfigError> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let w = parse_worker(line)?;
        if out.insert(w.key(), w.clone()).is_some() {
            let (id, rank) = w.key();
            return Err(ConfigError::Worker {
                entry: line.to_owned(),
                why: format!("worker {id}:{rank} is listed twice"),
            });
        }
    }
    Ok(out)
}

/// What kind of file `t` is, in words.
fn kind(t: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// Reads the workers file at `path`: a regular file (a symbolic link to one is followed) of at
/// most [`WORKERS_FILE_BYTES_MAX`] bytes. Opened without blocking (a FIFO with no writer would
/// block an ordinary open forever) and checked on the opened descriptor, so that what is read is
/// what was checked; a device or FIFO, whose size says nothing, is refused, and the read itself
/// stops past the bound whatever the size said.
pub fn read_workers_file(path: &Path) -> Result<String, String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| format!("opening {}: {e}", path.display()))?;
    let meta = file
        .metadata()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if !meta.file_type().is_file() {
        return Err(format!(
            "{} is {}, not a regular file",
            path.display(),
            kind(meta.file_type())
        ));
    }
    let mut bytes = Vec::new();
    file.take(WORKERS_FILE_BYTES_MAX + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("reading {}: {e}", path.display()))?;
    if bytes.len() as u64 > WORKERS_FILE_BYTES_MAX {
        return Err(format!(
            "{} is longer than {WORKERS_FILE_BYTES_MAX} bytes",
            path.display()
        ));
    }
    String::from_utf8(bytes).map_err(|e| format!("{} is not UTF-8: {e}", path.display()))
}

/// Follows the workers file at `path`, checking it every `every`, until the router is dropped.
pub fn watch(
    router: &Arc<Router>,
    path: PathBuf,
    every: Duration,
) -> std::io::Result<JoinHandle<()>> {
    let weak: Weak<Router> = Arc::downgrade(router);
    let first = sync(router, &path, &BTreeMap::new(), None);
    std::thread::Builder::new()
        .name("kvbm-router-workers-file".into())
        .spawn(move || {
            let (mut known, mut last_text) = first;
            loop {
                std::thread::sleep(every);
                let Some(router) = weak.upgrade() else { return };
                let (k, t) = sync(&router, &path, &known, last_text.as_deref());
                known = k;
                last_text = t;
            }
        })
}

/// Applies the file's current contents against `known` (what the file registered before);
/// returns what the file now registers and the text read.
fn sync(
    router: &Router,
    path: &Path,
    known: &BTreeMap<WorkerKey, WorkerSpec>,
    last_text: Option<&str>,
) -> (BTreeMap<WorkerKey, WorkerSpec>, Option<String>) {
    let text = match read_workers_file(path) {
        Ok(t) => t,
        Err(err) => {
            tracing::warn!(path = %path.display(), error = %err, "workers file unreadable; workers unchanged");
            router.metrics().workers_file_errors.inc();
            return (known.clone(), last_text.map(str::to_owned));
        }
    };
    if last_text == Some(text.as_str()) {
        return (known.clone(), Some(text));
    }
    let wanted = match parse_workers_file(&text) {
        Ok(w) => w,
        Err(err) => {
            tracing::warn!(path = %path.display(), error = %err, "workers file refused; workers unchanged");
            router.metrics().workers_file_errors.inc();
            return (known.clone(), Some(text));
        }
    };
    let mut now = BTreeMap::new();
    for (key, w) in &wanted {
        if known.get(key) == Some(w) {
            now.insert(*key, w.clone());
            continue;
        }
        // Only its HTTP server moved: keep following its events and its index state.
        if known.get(key).is_some_and(|k| k.events == w.events)
            && router.set_http_url(*key, w.http.clone())
        {
            now.insert(*key, w.clone());
            continue;
        }
        match router.register(w.clone()) {
            Ok(()) => {
                now.insert(*key, w.clone());
            }
            Err(err) => {
                tracing::warn!(worker = ?key, error = %err, "worker from the workers file not registered");
                router.metrics().workers_file_errors.inc();
            }
        }
    }
    for key in known.keys() {
        if !wanted.contains_key(key) {
            router.unregister(*key);
        }
    }
    tracing::info!(path = %path.display(), workers = now.len(), "workers file applied");
    (now, Some(text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_files_parse_with_comments_and_refuse_bad_lines() {
        let w = parse_workers_file(
            "# fleet\n1=tcp://127.0.0.1:5557\n\n2:1=tcp://h:1,replay=tcp://h:2,http=http://h:8000  # second\n",
        )
        .unwrap();
        assert_eq!(w.len(), 2);
        assert_eq!(w[&(2, 1)].events.replay.as_deref(), Some("tcp://h:2"));
        assert_eq!(w[&(2, 1)].http.as_deref(), Some("http://h:8000"));
        assert_eq!(w[&(1, 0)].http, None);
        assert!(parse_workers_file("1=tcp://h:1\nnope\n").is_err());
        assert!(parse_workers_file("1=tcp://h:1\n1=tcp://h:2\n").is_err());
        assert!(parse_workers_file("").unwrap().is_empty());
    }

    #[test]
    fn workers_files_that_are_not_regular_files_or_too_long_are_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        // A link to a device whose size reads 0 and whose contents never end.
        let zero = dir.path().join("zero");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let started = std::time::Instant::now();
        let e = read_workers_file(&zero).unwrap_err();
        assert!(
            e.contains("a character device") && e.contains("zero"),
            "{e}"
        );
        // A FIFO with no writer: an ordinary open would wait for one forever.
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let e = read_workers_file(&fifo).unwrap_err();
        assert!(e.contains("a FIFO") && e.contains("fifo"), "{e}");
        let e = read_workers_file(dir.path()).unwrap_err();
        assert!(e.contains("a directory"), "{e}");
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        // Over the bound, and at it.
        let long = dir.path().join("long");
        std::fs::write(&long, vec![b'#'; WORKERS_FILE_BYTES_MAX as usize + 1]).unwrap();
        let e = read_workers_file(&long).unwrap_err();
        assert!(e.contains("longer than"), "{e}");
        std::fs::write(&long, vec![b'#'; WORKERS_FILE_BYTES_MAX as usize]).unwrap();
        assert_eq!(
            read_workers_file(&long).unwrap().len(),
            WORKERS_FILE_BYTES_MAX as usize
        );
        let e = read_workers_file(&dir.path().join("absent")).unwrap_err();
        assert!(e.contains("absent"), "{e}");
    }
}
