//! `--manifests PATH`: Services, EndpointSlices and Nodes from YAML/JSON files instead of an
//! API server, re-read whenever the path changes.
//!
//! A file may hold several documents (`---`) and `v1/List` objects (what `kubectl get -o yaml`
//! prints). Each document is parsed on its own, so one that is broken, of an unknown kind or
//! invalid is reported with its file, document number and object name, and every other
//! object is still served.

use std::{
    borrow::Cow,
    collections::{BTreeMap, HashMap},
    fs,
    hash::{BuildHasher, RandomState},
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use anyhow::{Context, Result};
use notify::{RecursiveMode, Watcher};
use serde_yaml::Value;
use tokio::sync::mpsc;

use super::Snapshot;
use crate::model::{
    objects::{display_name, NodeInfo, Validated},
    Origin, Problem, ProblemKind, ServiceInfo, SliceInfo, Stored,
};
use k8s_openapi::api::core::v1::Node;

/// Reads a file, or every `.yaml`/`.yml`/`.json` file under a directory (recursively; names
/// starting with `.` are skipped, which also skips the `..data` bookkeeping of a mounted
/// ConfigMap while its symlinked files are read), from scratch.
pub fn load(path: &Path) -> Result<Snapshot> {
    Reader::new(path).load()
}

/// The manifest source between reloads: what each file held when it was last read, so that
/// a reload reads only the files whose metadata changed and parses only the documents whose
/// text changed (YAML parsing is nearly all of a reload's time: ~1 s for 10 000 Services
/// with their EndpointSlices).
pub struct Reader {
    path: PathBuf,
    files: BTreeMap<PathBuf, FileState>,
    hasher: RandomState,
    /// Files read and documents parsed, since the start (for tests and the debug log).
    pub files_read: usize,
    pub documents_parsed: usize,
}

/// What makes a file's content different without reading it: a replaced file (rename, a
/// ConfigMap's symlink swap) has another inode; a rewritten one another size or times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    fn of(meta: &fs::Metadata) -> Stamp {
        use std::os::unix::fs::MetadataExt;
        Stamp {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }

    /// A stamp no file has (no file is `u64::MAX` bytes long): the file is read again at
    /// the next load.
    fn distrusted(self) -> Stamp {
        Stamp {
            len: u64::MAX,
            ..self
        }
    }
}

struct FileState {
    stamp: Stamp,
    documents: Vec<Document>,
}

/// One document of a file, parsed.
struct Document {
    /// Its first line, for its origin.
    line: usize,
    /// A hash of its text: the same text is not parsed again.
    hash: u64,
    parsed: Parsed,
}

/// One document's objects, validated. Origins are kept as what follows the document's own
/// (`" item 3"` inside a List) and completed when a snapshot is put together, so a document
/// that only moved within its file is not parsed again.
#[derive(Debug, Default)]
struct Parsed {
    services: Vec<(Arc<ServiceInfo>, String)>,
    slices: Vec<(Arc<SliceInfo>, String)>,
    nodes: Vec<NodeInfo>,
    /// With the origin suffix in `origin`.
    problems: Vec<Problem>,
}

impl Reader {
    pub fn new(path: &Path) -> Self {
        Reader {
            path: path.to_path_buf(),
            files: BTreeMap::new(),
            hasher: RandomState::new(),
            files_read: 0,
            documents_parsed: 0,
        }
    }

    /// Everything under the path, reading only the files that changed since the last call.
    pub fn load(&mut self) -> Result<Snapshot> {
        let mut problems = Vec::new();
        let files = manifest_files(&self.path, &mut problems)?;
        let mut next = BTreeMap::new();
        for file in files {
            let old = self.files.remove(&file);
            match self.read(&file, old) {
                Ok(state) => {
                    next.insert(file, state);
                }
                // The file may be replaced between listing and reading; the watcher will
                // call again. Report it rather than fail the whole load.
                Err(e) => problems.push(Problem {
                    origin: file.display().to_string().into(),
                    object: "file".into(),
                    message: format!("cannot be read: {e}"),
                    kind: ProblemKind::Invalid,
                }),
            }
        }
        self.files = next;
        let mut set = Snapshot {
            problems,
            ..Snapshot::default()
        };
        for (file, state) in &self.files {
            let file = file.display().to_string();
            for (index, doc) in state.documents.iter().enumerate() {
                doc.parsed
                    .add_to(&document_origin(&file, index, doc.line), &mut set);
            }
        }
        Ok(set)
    }

    /// Reads everything again at the next [`Reader::load`] (documents whose text is the
    /// same are still not parsed again): the periodic re-read, should a change have been
    /// missed by its metadata.
    pub fn forget_files(&mut self) {
        for state in self.files.values_mut() {
            state.stamp = state.stamp.distrusted();
        }
    }

    /// A file's documents: as they were, when its metadata is unchanged; else read again,
    /// parsing only documents not seen in it before.
    fn read(&mut self, file: &Path, old: Option<FileState>) -> std::io::Result<FileState> {
        let stamp = Stamp::of(&fs::metadata(file)?);
        let old = match old {
            Some(state) if state.stamp == stamp => return Ok(state),
            Some(state) => state.documents,
            None => Vec::new(),
        };
        let text = fs::read_to_string(file)?;
        self.files_read += 1;
        let mut known: HashMap<u64, Parsed> = old.into_iter().map(|d| (d.hash, d.parsed)).collect();
        let docs = split_documents(&text);
        let mut found: Vec<(u64, Option<Parsed>)> = docs
            .iter()
            .map(|(_, doc)| {
                let hash = self.hasher.hash_one(doc);
                (hash, known.remove(&hash))
            })
            .collect();
        let todo: Vec<usize> = (0..docs.len()).filter(|i| found[*i].1.is_none()).collect();
        self.documents_parsed += todo.len();
        let texts: Vec<&str> = todo.iter().map(|i| docs[*i].1.as_ref()).collect();
        for (i, parsed) in todo.into_iter().zip(parse_all(&texts)) {
            found[i].1 = Some(parsed);
        }
        let documents = docs
            .iter()
            .zip(found)
            .map(|((line, _), (hash, parsed))| Document {
                line: *line,
                hash,
                parsed: parsed.unwrap_or_default(),
            })
            .collect();
        // A stamp taken before the read: a write during it shows at the next reload. File
        // times advance in clock ticks, so a rewrite of the same length within a tick of
        // this read would keep the stamp: one this recent is not trusted (read again next
        // time), as git treats a racily clean index entry.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(i64::MAX, |d| d.as_secs() as i64);
        let stamp = if now - stamp.mtime.0 <= 1 {
            stamp.distrusted()
        } else {
            stamp
        };
        Ok(FileState { stamp, documents })
    }
}

/// Parses documents, on up to four threads when there are many (a first read of 100 000
/// Services is seconds of YAML parsing, and the node's cores are idle at start).
fn parse_all(texts: &[&str]) -> Vec<Parsed> {
    const PER_THREAD: usize = 256;
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(4)
        .min(texts.len() / PER_THREAD)
        .max(1);
    if threads == 1 {
        return texts.iter().map(|t| Parsed::document(t)).collect();
    }
    let chunk = texts.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let parts: Vec<_> = texts
            .chunks(chunk)
            .map(|part| {
                scope.spawn(move || part.iter().map(|t| Parsed::document(t)).collect::<Vec<_>>())
            })
            .collect();
        parts
            .into_iter()
            .flat_map(|p| p.join().expect("parsing does not panic (fuzzed)"))
            .collect()
    })
}

impl Parsed {
    fn document(text: &str) -> Parsed {
        let mut parsed = Parsed::default();
        match serde_yaml::from_str::<Value>(text) {
            Ok(value) => add_object(value, "", &mut parsed),
            Err(e) => parsed.problems.push(Problem {
                origin: "".into(),
                object: "document".into(),
                message: format!("not valid YAML: {e}"),
                kind: ProblemKind::Invalid,
            }),
        }
        // Kept until the document changes: 10 000s of them.
        parsed.services.shrink_to_fit();
        parsed.slices.shrink_to_fit();
        parsed
    }

    /// Adds this document's objects to `set`, the document's origin being `origin`; a name
    /// defined again replaces the earlier definition, with a problem that says so.
    fn add_to(&self, origin: &str, set: &mut Snapshot) {
        for p in &self.problems {
            set.problems.push(Problem {
                origin: format!("{origin}{}", p.origin).into(),
                ..p.clone()
            });
        }
        for (svc, suffix) in &self.services {
            put(
                svc,
                origin,
                suffix,
                &mut set.store.services,
                &mut set.problems,
            );
        }
        for (slice, suffix) in &self.slices {
            put(
                slice,
                origin,
                suffix,
                &mut set.store.slices,
                &mut set.problems,
            );
        }
        set.nodes.extend(self.nodes.iter().cloned());
    }
}

/// Stores one object under its name; a second definition wins, with a problem.
fn put<T: Validated>(
    object: &Arc<T>,
    origin: &str,
    suffix: &str,
    into: &mut BTreeMap<crate::model::ObjectName, Stored<T>>,
    problems: &mut Vec<Problem>,
) {
    let origin: Origin = format!("{origin}{suffix}").into();
    if let Some((_, earlier)) = into.get(object.name()) {
        problems.push(Problem {
            origin: origin.clone(),
            object: format!("{} {}", T::KIND, object.name()),
            message: format!("defined again (first in {earlier}); the later definition is used"),
            kind: ProblemKind::Invalid,
        });
    }
    into.insert(object.name().clone(), (Arc::clone(object), origin));
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
/// only itself. Returns (first line number, text) per non-empty document; the text is a
/// slice of `text` unless the document had to be pieced together (`--- {inline}`, `...`).
fn split_documents(text: &str) -> Vec<(usize, Cow<'_, str>)> {
    let mut docs = Vec::new();
    let mut doc = Piece::at(0);
    let mut start = 1;
    let mut offset = 0;
    for (i, raw) in text.split_inclusive('\n').enumerate() {
        // As `str::lines` reads a line.
        let line = raw.strip_suffix('\n').unwrap_or(raw);
        let line = line.strip_suffix('\r').unwrap_or(line);
        offset += raw.len();
        let is_separator =
            line.starts_with("---") && line[3..].chars().next().is_none_or(|c| c.is_whitespace());
        if is_separator {
            docs.push((
                start,
                std::mem::replace(&mut doc, Piece::at(offset)).text(text),
            ));
            start = i + 1;
            // `--- {inline: doc}` keeps its content.
            let rest = line[3..].trim();
            if !rest.is_empty() && !rest.starts_with('#') {
                doc.owned = Some(format!("{rest}\n"));
            }
            continue;
        }
        if line == "..." {
            doc.own(text);
            continue;
        }
        match &mut doc.owned {
            Some(owned) => {
                owned.push_str(line);
                owned.push('\n');
            }
            None => doc.end = offset,
        }
    }
    docs.push((start, doc.text(text)));
    docs.retain(|(_, d)| {
        d.lines()
            .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
    });
    docs
}

/// A document being split off: a range of the text, until it has to be pieced together.
struct Piece {
    begin: usize,
    end: usize,
    owned: Option<String>,
}

impl Piece {
    fn at(offset: usize) -> Piece {
        Piece {
            begin: offset,
            end: offset,
            owned: None,
        }
    }

    fn own(&mut self, text: &str) {
        if self.owned.is_none() {
            self.owned = Some(text[self.begin..self.end].to_string());
        }
    }

    fn text(self, text: &str) -> Cow<'_, str> {
        match self.owned {
            Some(owned) => Cow::Owned(owned),
            None => Cow::Borrowed(&text[self.begin..self.end]),
        }
    }
}

/// Where a file's `index`th document (from 0) starting at `line` came from, for messages.
fn document_origin(file: &str, index: usize, line: usize) -> String {
    format!("{file} document {} (line {line})", index + 1)
}

/// Parses one file's text into `set`.
pub fn parse_into(text: &str, file: &str, set: &mut Snapshot) {
    for (index, (line, doc)) in split_documents(text).into_iter().enumerate() {
        Parsed::document(&doc).add_to(&document_origin(file, index, line), set);
    }
}

fn str_field<'a>(value: &'a Value, key: &str) -> Option<&'a str> {
    value.get(key).and_then(Value::as_str)
}

/// Adds one parsed value (an object, or a List of them) to `parsed`; `origin` is what
/// follows the document's origin.
fn add_object(value: Value, origin: &str, parsed: &mut Parsed) {
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
        origin: origin.into(),
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
                add_object(item, &format!("{origin} item {i}"), parsed);
            }
        }
        ("v1", "Service") => {
            let blank = problem(String::new());
            if let Some(svc) = validated::<ServiceInfo>(value, blank, &mut parsed.problems) {
                parsed.services.push((Arc::new(svc), origin.into()));
            }
        }
        ("discovery.k8s.io/v1", "EndpointSlice") => {
            let blank = problem(String::new());
            if let Some(slice) = validated::<SliceInfo>(value, blank, &mut parsed.problems) {
                parsed.slices.push((Arc::new(slice), origin.into()));
            }
        }
        ("v1", "Node") => match serde_yaml::from_value::<Node>(value) {
            Ok(node) => parsed.nodes.push(NodeInfo::from_api(&node)),
            Err(e) => parsed
                .problems
                .push(problem(format!("not a valid Node: {e}"))),
        },
        ("", _) | (_, "") => parsed.problems.push(problem(
            "has no apiVersion/kind; expected a Kubernetes object".into(),
        )),
        _ => parsed.problems.push(problem(format!(
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

/// Parses and validates one object; a problem names it and skips it. `blank` is a problem
/// naming the document, to fill in.
fn validated<T: Validated>(value: Value, blank: Problem, problems: &mut Vec<Problem>) -> Option<T> {
    let with = |message: String| Problem {
        message,
        ..blank.clone()
    };
    let obj = match serde_yaml::from_value::<T::Api>(value) {
        Ok(obj) => obj,
        Err(e) => {
            problems.push(with(format!("not a valid {}: {e}", T::KIND)));
            return None;
        }
    };
    match T::validate(&obj) {
        Err(e) => {
            problems.push(Problem {
                object: format!("{} {}", T::KIND, display_name(T::meta(&obj))),
                ..with(format!("{e}; skipped"))
            });
            None
        }
        Ok(info) => Some(info),
    }
}

/// Watches `path` and sends `()` on `tx` whenever something under it may have changed.
///
/// The parent directory is watched as well as the path itself, so atomic replacement by
/// rename and the symlink swap of a mounted ConfigMap (`..data` re-pointed) are both seen.
/// Events are coalesced: a burst of writes yields one reload, `settle` after it began.
pub fn watch(
    path: &Path,
    settle: Duration,
    tx: mpsc::Sender<()>,
) -> Result<notify::RecommendedWatcher> {
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
    tokio::spawn(async move {
        while raw_rx.recv().await.is_some() {
            // Let a burst (editor save, ConfigMap swap) finish, then reload once.
            tokio::time::sleep(settle).await;
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
