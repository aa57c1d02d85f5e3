//! The docs link check: every relative link in README.md, CHANGELOG.md, BENCHMARKS.md and
//! docs/ resolves to a file, and a `#fragment` into a Markdown file to one of its headings
//! (GitHub's anchors).

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};

/// Checks the links under `root`; the number of links checked.
pub fn check(root: &Path) -> Result<usize> {
    let mut files = vec![
        root.join("README.md"),
        root.join("CHANGELOG.md"),
        root.join("BENCHMARKS.md"),
    ];
    markdown_under(&root.join("docs"), &mut files)?;
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in &files {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        for target in links(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            if let Err(e) = resolve(file, &target) {
                broken.push(format!(
                    "{}: {target}: {e}",
                    file.strip_prefix(root).unwrap_or(file).display()
                ));
            }
        }
    }
    if !broken.is_empty() {
        bail!("{} broken links:\n{}", broken.len(), broken.join("\n"));
    }
    Ok(checked)
}

fn markdown_under(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            markdown_under(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "md") {
            out.push(path);
        }
    }
    Ok(())
}

/// The targets of inline links and images, `[text](target)`, outside code.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Inline code spans may hold "](" that is no link.
        let prose: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        let mut rest = prose.as_str();
        while let Some(i) = rest.find("](") {
            rest = &rest[i + 2..];
            let Some(end) = rest.find(')') else { break };
            let target = rest[..end].split_whitespace().next().unwrap_or("");
            if !target.is_empty() {
                out.push(target.to_string());
            }
            rest = &rest[end..];
        }
    }
    out
}

fn resolve(from: &Path, target: &str) -> Result<()> {
    let (path, fragment) = match target.split_once('#') {
        Some((p, f)) => (p, Some(f)),
        None => (target, None),
    };
    let file = if path.is_empty() {
        from.to_path_buf()
    } else {
        from.parent().unwrap_or(Path::new(".")).join(path)
    };
    if !file.exists() {
        bail!("no such file");
    }
    if let Some(fragment) = fragment {
        if file.extension().is_some_and(|e| e == "md") {
            let text = std::fs::read_to_string(&file)?;
            if !anchors(&text).contains(fragment) {
                bail!("no heading with anchor #{fragment}");
            }
        }
    }
    Ok(())
}

/// GitHub's heading anchors: lower case, punctuation other than `-` and `_` dropped,
/// spaces to `-`, repeats numbered.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        if fenced || !line.starts_with('#') {
            continue;
        }
        let heading = line.trim_start_matches('#').trim();
        let slug: String = heading
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                _ => None,
            })
            .collect();
        let mut anchor = slug.clone();
        let mut n = 1;
        while seen.contains(&anchor) {
            anchor = format!("{slug}-{n}");
            n += 1;
        }
        seen.insert(anchor);
    }
    seen
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anchors_follow_githubs_rules() {
        let a = anchors(
            "# Life cycle: restarts and upgrades\n## `--cleanup`, and modes\n## Tests\n## Tests\n",
        );
        for wanted in [
            "life-cycle-restarts-and-upgrades",
            "--cleanup-and-modes",
            "tests",
            "tests-1",
        ] {
            assert!(a.contains(wanted), "{wanted} not in {a:?}");
        }
    }

    #[test]
    fn links_outside_code_only() {
        let text = "see [a](docs/a.md#x) and `[b](no)`\n```\n[c](no)\n```\n![img](p.png \"t\")\n";
        assert_eq!(links(text), ["docs/a.md#x", "p.png"]);
    }
}
