//! Every driver function kvbm-cuda names is one this driver exports: its `sys::cu*` calls, its
//! `has_symbol("...")` lookups and the `REQUIRED_ENTRY_POINTS` `CudaBackend::open` checks for,
//! against `src/api.rs`.
//! (What cudarc's safe API calls underneath is exercised by `tests/kvbm_bench.rs`, where a
//! missing symbol is a cudarc panic.)

use std::collections::BTreeSet;
use std::path::Path;

/// Identifiers starting with `cu` + an uppercase letter that follow `prefix` in `text`.
fn names_after(text: &str, prefix: &str) -> BTreeSet<String> {
    text.match_indices(prefix)
        .filter_map(|(at, _)| {
            let rest = &text[at + prefix.len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            let mut chars = name.chars().skip(2);
            (name.starts_with("cu") && chars.next().is_some_and(|c| c.is_ascii_uppercase()))
                .then_some(name)
        })
        .collect()
}

#[test]
fn every_entry_point_kvbm_cuda_names_is_exported() {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let api = std::fs::read_to_string(manifest.join("src/api.rs")).unwrap();
    let exported = names_after(&api, "pub unsafe extern \"C\" fn ");
    let mut called = BTreeSet::new();
    for entry in std::fs::read_dir(manifest.join("../src")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).unwrap();
            called.extend(names_after(&text, "sys::"));
            called.extend(names_after(&text, "has_symbol(\""));
            if let Some(at) = text.find("REQUIRED_ENTRY_POINTS: &[&str] = &[") {
                let list = &text[at..];
                let list = &list[..list.find("];").unwrap()];
                let required = names_after(list, "\"");
                assert!(required.len() > 10, "REQUIRED_ENTRY_POINTS: {required:?}");
                called.extend(required);
            }
        }
    }
    assert!(
        called.contains("cuMemcpyAsync"),
        "the scan found kvbm-cuda's calls: {called:?}"
    );
    let missing: Vec<&String> = called.difference(&exported).collect();
    assert!(
        missing.is_empty(),
        "kvbm-cuda calls {missing:?}, which the simulator lacks"
    );
}
