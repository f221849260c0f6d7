//! Tidy checks over the workspace's sources, as ARCHITECTURE.md's invariants state them.

use std::path::{Path, PathBuf};

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Architecture invariant: every queue has a named bound. No library or binary source creates
/// an unbounded channel (tests may).
#[test]
fn no_source_creates_an_unbounded_queue() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut files = Vec::new();
    for krate in std::fs::read_dir(root).unwrap().flatten() {
        let src = krate.path().join("src");
        if krate.path().join("Cargo.toml").exists() && src.is_dir() {
            sources(&src, &mut files);
        }
    }
    assert!(files.len() > 20, "the workspace's sources were found");
    let offenders: Vec<String> = files
        .iter()
        .flat_map(|f| {
            let text = std::fs::read_to_string(f).unwrap();
            text.lines()
                .enumerate()
                .filter(|(_, l)| {
                    // A line may say why its queue is bounded anyway ("// bounded: <reason>").
                    !l.contains("// bounded: ")
                })
                .filter(|(_, l)| {
                    // std's `mpsc::channel()` is unbounded; tokio's `mpsc::channel(n)` is not.
                    l.contains("::unbounded(")
                        || l.contains("unbounded_channel(")
                        || l.contains("mpsc::channel()")
                        || l.contains("mpsc::channel::<")
                })
                .map(|(n, l)| format!("{}:{}: {}", f.display(), n + 1, l.trim()))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(
        offenders.is_empty(),
        "unbounded queues:\n{}",
        offenders.join("\n")
    );
}
