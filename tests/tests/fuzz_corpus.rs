//! Every fuzz target's corpus, and every input that once failed it, run through the same
//! entry points as the fuzzers (`proxy_agent::fuzz`), as an ordinary test: a target that
//! panics on what it once handled fails here without libFuzzer. `cargo xtask fuzz` grows
//! the corpus; a crash it finds goes to `tests/fuzz/regressions/<target>/` with its fix.

use std::path::{Path, PathBuf};

fn inputs(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| p.is_file())
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

/// The libFuzzer targets are the entry points, one to one.
#[test]
fn every_entry_point_has_a_fuzz_target() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/fuzz_targets");
    let mut files: Vec<String> = inputs(&dir)
        .iter()
        .filter_map(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .collect();
    files.sort();
    let mut targets: Vec<String> = proxy_agent::fuzz::TARGETS
        .iter()
        .map(|(name, _)| name.to_string())
        .collect();
    targets.sort();
    assert_eq!(files, targets);
}

#[test]
fn every_fuzz_target_handles_its_corpus_and_past_crashes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    for (target, _) in proxy_agent::fuzz::TARGETS {
        let corpus = inputs(&root.join("corpus").join(target));
        assert!(!corpus.is_empty(), "{target} has no corpus");
        for input in corpus
            .iter()
            .chain(&inputs(&root.join("regressions").join(target)))
        {
            let data = std::fs::read(input).unwrap();
            let outcome = std::panic::catch_unwind(|| proxy_agent::fuzz::run(target, &data));
            assert!(
                matches!(outcome, Ok(true)),
                "{target} failed on {}",
                input.display()
            );
        }
    }
}
