//! The router index has one writer, the pump thread (ARCHITECTURE.md): every write lock of the
//! index in the sources is taken inside `pump_loop`; HTTP handlers and `unregister` ask the pump.

#[test]
fn only_the_pump_writes_the_index() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut outside = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        // The pump's body: from its signature to the next item at column 0.
        let pump = text.find("\nfn pump_loop(").map(|start| {
            let end = text[start + 1..]
                .find("\n}\n")
                .map_or(text.len(), |e| start + 1 + e);
            start..end
        });
        for (at, _) in text.match_indices("index.write()") {
            if !pump.as_ref().is_some_and(|r| r.contains(&at)) {
                let line = text[..at].lines().count();
                outside.push(format!("{}:{line}", path.display()));
            }
        }
    }
    assert!(
        outside.is_empty(),
        "index written outside the pump: {outside:?}"
    );
}
