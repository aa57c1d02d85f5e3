//! `--manifests PATH`: Services, EndpointSlices and Nodes from YAML/JSON files instead of an
//! API server, re-read whenever the path changes.
//!
//! A file may hold several documents (`---`) and `v1/List` objects (what `kubectl get -o yaml`
//! prints). Each document is parsed on its own, so one that is broken, of an unknown kind or
//! invalid is reported with its file, document number and object name, and every other
//! object is still served.

use std::{
    fs,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, Result};
use notify::{RecursiveMode, Watcher};
use serde_yaml::Value;
use tokio::sync::mpsc;

use super::Snapshot;
use crate::model::{
    objects::{display_name, NodeInfo, Validated},
    Origin, Problem, ProblemKind, ServiceInfo, SliceInfo,
};
use k8s_openapi::api::core::v1::Node;

/// Reads a file, or every `.yaml`/`.yml`/`.json` file under a directory (recursively; names
/// starting with `.` are skipped, which also skips the `..data` bookkeeping of a mounted
/// ConfigMap while its symlinked files are read).
pub fn load(path: &Path) -> Result<Snapshot> {
    let mut set = Snapshot::default();
    let files = manifest_files(path, &mut set.problems)?;
    for file in files {
        let text = match fs::read_to_string(&file) {
            Ok(t) => t,
            // The file may be replaced between listing and reading; the watcher will call
            // again. Report it rather than fail the whole load.
            Err(e) => {
                set.problems.push(Problem {
                    origin: file.display().to_string().into(),
                    object: "file".into(),
                    message: format!("cannot be read: {e}"),
                    kind: ProblemKind::Invalid,
                });
                continue;
            }
        };
        parse_into(&text, &file.display().to_string(), &mut set);
    }
    Ok(set)
}

/// The manifest files under `path`. Each directory is read once however many symlinks lead
/// to it: a symlink back up the tree is reported and skipped, not walked until the path is
/// too long.
fn manifest_files(path: &Path, problems: &mut Vec<Problem>) -> Result<Vec<PathBuf>> {
    use std::os::unix::fs::MetadataExt;
    let meta = fs::metadata(path).with_context(|| format!("--manifests {}", path.display()))?;
    if meta.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files = Vec::new();
    let mut seen =
        std::collections::BTreeMap::from([((meta.dev(), meta.ino()), path.to_path_buf())]);
    let mut dirs = vec![path.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let entries =
            fs::read_dir(&dir).with_context(|| format!("reading directory {}", dir.display()))?;
        for entry in entries {
            let entry = entry?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with('.') {
                continue;
            }
            let p = entry.path();
            // fs::metadata follows symlinks: ConfigMap files are symlinks into ..data/.
            match fs::metadata(&p) {
                Ok(m) if m.is_dir() => match seen.get(&(m.dev(), m.ino())) {
                    Some(first) => problems.push(Problem {
                        origin: p.display().to_string().into(),
                        object: "directory".into(),
                        message: format!(
                            "is {} again (a symlink loop or a second link); skipped",
                            first.display()
                        ),
                        kind: ProblemKind::Invalid,
                    }),
                    None => {
                        seen.insert((m.dev(), m.ino()), p.clone());
                        dirs.push(p);
                    }
                },
                Ok(m) if m.is_file() => {
                    if matches!(
                        p.extension().and_then(|e| e.to_str()),
                        Some("yaml" | "yml" | "json")
                    ) {
                        files.push(p);
                    }
                }
                _ => {}
            }
        }
    }
    files.sort();
    Ok(files)
}

/// Splits a multi-document YAML stream at `---` lines. Done by hand rather than by the YAML
/// parser, whose stream stops at the first broken document: here a broken document costs
/// only itself. Returns (first line number, text) per non-empty document.
fn split_documents(text: &str) -> Vec<(usize, String)> {
    let mut docs = Vec::new();
    let mut current = String::new();
    let mut start = 1;
    for (i, line) in text.lines().enumerate() {
        let is_separator =
            line.starts_with("---") && line[3..].chars().next().is_none_or(|c| c.is_whitespace());
        if is_separator {
            docs.push((start, std::mem::take(&mut current)));
            start = i + 1;
            // `--- {inline: doc}` keeps its content.
            let rest = line[3..].trim();
            if !rest.is_empty() && !rest.starts_with('#') {
                current.push_str(rest);
                current.push('\n');
            }
            continue;
        }
        if line == "..." {
            continue;
        }
        current.push_str(line);
        current.push('\n');
    }
    docs.push((start, current));
    docs.into_iter()
        .filter(|(_, d)| {
            d.lines()
                .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        })
        .collect()
}

/// Parses one file's text into `set`.
pub fn parse_into(text: &str, file: &str, set: &mut Snapshot) {
    for (index, (line, doc)) in split_documents(text).into_iter().enumerate() {
        let origin: Origin = format!("{file} document {} (line {line})", index + 1).into();
        match serde_yaml::from_str::<Value>(&doc) {
            Ok(value) => add_object(value, &origin, set),
            Err(e) => set.problems.push(Problem {
                origin,
                object: "document".into(),
                message: format!("not valid YAML: {e}"),
                kind: ProblemKind::Invalid,
            }),
        }
    }
}

fn str_field<'a>(value: &'a Value, key: &str) -> Option<&'a str> {
    value.get(key).and_then(Value::as_str)
}

fn add_object(value: Value, origin: &Origin, set: &mut Snapshot) {
    let api_version = str_field(&value, "apiVersion").unwrap_or("").to_string();
    let kind = str_field(&value, "kind").unwrap_or("").to_string();
    let name = value
        .get("metadata")
        .map(|m| {
            format!(
                "{}/{}",
                str_field(m, "namespace").unwrap_or("default"),
                str_field(m, "name").unwrap_or("<unnamed>")
            )
        })
        .unwrap_or_else(|| "<no metadata>".into());
    let problem = |message: String| Problem {
        origin: origin.clone(),
        object: format!("{kind} {name}"),
        message,
        kind: ProblemKind::Invalid,
    };
    match (api_version.as_str(), kind.as_str()) {
        ("v1", "List") => {
            let items = match value.get("items") {
                Some(Value::Sequence(items)) => items.clone(),
                _ => Vec::new(),
            };
            for (i, item) in items.into_iter().enumerate() {
                let item_origin: Origin = format!("{origin} item {i}").into();
                add_object(item, &item_origin, set);
            }
        }
        ("v1", "Service") => {
            let problem = problem(String::new());
            add_validated::<ServiceInfo>(
                value,
                origin,
                &mut set.store.services,
                &mut set.problems,
                problem,
            )
        }
        ("discovery.k8s.io/v1", "EndpointSlice") => {
            let problem = problem(String::new());
            add_validated::<SliceInfo>(
                value,
                origin,
                &mut set.store.slices,
                &mut set.problems,
                problem,
            )
        }
        ("v1", "Node") => match serde_yaml::from_value::<Node>(value) {
            Ok(node) => set.nodes.push(NodeInfo::from_api(&node)),
            Err(e) => set.problems.push(problem(format!("not a valid Node: {e}"))),
        },
        ("", _) | (_, "") => set.problems.push(problem(
            "has no apiVersion/kind; expected a Kubernetes object".into(),
        )),
        _ => set.problems.push(problem(format!(
            "unsupported kind {kind} (apiVersion {api_version}); expected v1/Service, \
             discovery.k8s.io/v1/EndpointSlice, v1/Node or v1/List; skipped"
        ))),
    }
}

fn is_change(kind: &notify::EventKind) -> bool {
    use notify::{event::ModifyKind, EventKind};
    match kind {
        EventKind::Create(_) | EventKind::Remove(_) => true,
        EventKind::Modify(ModifyKind::Metadata(_)) => false,
        EventKind::Modify(_) => true,
        _ => false,
    }
}

/// Parses, validates and stores one object; a problem names it and skips it. `blank` is a
/// problem naming the document, to fill in.
fn add_validated<T: Validated>(
    value: Value,
    origin: &Origin,
    into: &mut std::collections::BTreeMap<crate::model::ObjectName, (T, Origin)>,
    problems: &mut Vec<Problem>,
    blank: Problem,
) {
    let with = |message: String| Problem {
        message,
        ..blank.clone()
    };
    let obj = match serde_yaml::from_value::<T::Api>(value) {
        Ok(obj) => obj,
        Err(e) => return problems.push(with(format!("not a valid {}: {e}", T::KIND))),
    };
    match T::validate(&obj) {
        Err(e) => problems.push(Problem {
            object: format!("{} {}", T::KIND, display_name(T::meta(&obj))),
            ..with(format!("{e}; skipped"))
        }),
        Ok(info) => {
            if let Some((_, earlier)) = into.get(info.name()) {
                problems.push(with(format!(
                    "defined again (first in {earlier}); the later definition is used"
                )));
            }
            into.insert(info.name().clone(), (info, origin.clone()));
        }
    }
}

/// Watches `path` and sends `()` on `tx` whenever something under it may have changed.
///
/// The parent directory is watched as well as the path itself, so atomic replacement by
/// rename and the symlink swap of a mounted ConfigMap (`..data` re-pointed) are both seen.
/// Events are coalesced: a burst of writes yields one reload after it settles.
pub fn watch(path: &Path, tx: mpsc::Sender<()>) -> Result<notify::RecommendedWatcher> {
    let (raw_tx, mut raw_rx) = mpsc::unbounded_channel::<()>();
    // Watching a file means watching its directory, where other files (logs, say) may
    // change all the time: only events for the file itself, or for a ConfigMap's `..data`
    // swap, count. Reads (our own reloads included) never do.
    let only: Option<std::ffi::OsString> = if path.is_dir() {
        None
    } else {
        path.file_name().map(|n| n.to_os_string())
    };
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        let Ok(event) = res else { return };
        if !is_change(&event.kind) {
            return;
        }
        let relevant = match &only {
            None => true,
            Some(name) => event.paths.iter().any(|p| {
                p.file_name().is_some_and(|f| {
                    f == name.as_os_str() || f.to_string_lossy().starts_with("..data")
                })
            }),
        };
        if relevant {
            let _ = raw_tx.send(());
        }
    })
    .context("creating the manifest watcher (inotify)")?;
    // Not canonicalised: a ConfigMap file is a symlink into a directory that the next
    // update deletes; the directory the user named is the one that stays.
    if path.is_dir() {
        watcher
            .watch(path, RecursiveMode::Recursive)
            .with_context(|| format!("watching {}", path.display()))?;
    } else {
        let parent = path.parent().unwrap_or(Path::new("/"));
        watcher
            .watch(parent, RecursiveMode::NonRecursive)
            .with_context(|| format!("watching {}", parent.display()))?;
    }
    let debounce = Duration::from_millis(100);
    tokio::spawn(async move {
        while raw_rx.recv().await.is_some() {
            // Let a burst (editor save, ConfigMap swap) finish, then reload once.
            tokio::time::sleep(debounce).await;
            while raw_rx.try_recv().is_ok() {}
            if tx.send(()).await.is_err() {
                break;
            }
        }
    });
    Ok(watcher)
}

#[cfg(test)]
mod tests;
