//! The docs name only what exists: every `kvferry…::` path, every `KVFERRY_*` name, every
//! relative link and every `scripts/…` command in the README files and `docs/`.
//!
//! The paths a user imports (`kvferry::…` in the user-facing docs) are compiled: each must be
//! one of the `use` lines below, so a doc naming a new path fails until it is added here, and
//! an item renamed or made private fails to build. Paths into the other crates (the design
//! docs name internal modules) are resolved through the sources: modules by their files,
//! items by their declarations.

#![allow(unused_imports)]

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use kvferry::abi;
use kvferry::agent;
use kvferry::agent::{Agent, DecodeAgent, PrefillAgent};
use kvferry::config;
use kvferry::config::{FileConfig, load, load_file};
use kvferry::logging;
use kvferry::metrics;
use kvferry::planning;
use kvferry::planning::PairPlanner;
use kvferry::registry;

/// The functions and methods the user-facing docs name, which `use` cannot import.
#[allow(dead_code)]
fn named_functions() {
    let _ = kvferry::agent::PrefillAgent::start;
}

/// The docs a user reads to embed or run kvferry: their `kvferry::` paths must be imports
/// of this file.
const USER_DOCS: &[&str] = &[
    "README.md",
    "docs/USAGE.md",
    "docs/EMBEDDING.md",
    "docs/vllm.md",
    "python/README.md",
    "host/kvferry/README.md",
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every Markdown file that documents the project (README files and `docs/`), and the
/// architecture picture's source.
fn docs() -> Vec<PathBuf> {
    let root = root();
    let mut out = vec![
        root.join("README.md"),
        root.join("docs/img/architecture.dot"),
    ];
    for dir in ["docs", "python", "examples/planner-template", "host/capi"] {
        out.extend(markdown_in(&root.join(dir)));
    }
    for dir in ["host", "planners"] {
        for entry in fs::read_dir(root.join(dir)).unwrap() {
            let readme = entry.unwrap().path().join("README.md");
            if readme.is_file() && !out.contains(&readme) {
                out.push(readme);
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

fn markdown_in(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    out.sort();
    out
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn shown(path: &Path) -> String {
    path.strip_prefix(root())
        .unwrap_or(path)
        .display()
        .to_string()
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The `kvferry…::a::b` paths in `text` (without a trailing `::` or `::*`).
fn rust_paths(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("kvferry") {
        let starts_word = !rest[..at].ends_with(is_ident);
        let tail = &rest[at..];
        let len = tail
            .char_indices()
            .find(|&(_, c)| !(is_ident(c) || c == ':'))
            .map_or(tail.len(), |(i, _)| i);
        let path = tail[..len].trim_end_matches(':');
        if starts_word && path.contains("::") {
            out.insert(path.to_string());
        }
        rest = &tail[len.max(1)..];
    }
    out
}

/// The `KVFERRY_*` names in `text`.
fn env_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("KVFERRY_") {
        let tail = &rest[at..];
        let len = tail
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        if !rest[..at].ends_with(is_ident) {
            out.insert(tail[..len].trim_end_matches('_').to_string());
        }
        rest = &tail[len..];
    }
    out
}

/// Every source file of the project (not the docs, not build output).
fn sources() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if path.is_dir() {
                if !name.starts_with('.') && !["target", "docs", "__pycache__"].contains(&&*name) {
                    walk(&path, out);
                }
            } else if [".rs", ".py", ".h", ".c", ".toml", ".in"]
                .iter()
                .any(|e| name.ends_with(e))
                || path.parent().is_some_and(|p| p.ends_with("scripts"))
                || path.ends_with(".ci/run")
            {
                out.push(path);
            }
        }
    }
    let root = root();
    let mut out = Vec::new();
    for dir in [
        "host",
        "planners",
        "planner-abi",
        "python",
        "scripts",
        "examples",
        "tests",
    ] {
        if root.join(dir).is_dir() {
            walk(&root.join(dir), &mut out);
        }
    }
    out.push(root.join(".ci/run"));
    out
}

/// The workspace's crates by the name code uses (`kvferry_transfer`), with their `src/`.
fn crates() -> Vec<(String, PathBuf)> {
    let root = root();
    let mut out = Vec::new();
    for manifest in sources().into_iter().filter(|p| p.ends_with("Cargo.toml")) {
        let text = read(&manifest);
        let Some(name) = text.lines().find_map(|l| {
            l.strip_prefix("name = \"")?
                .strip_suffix('"')
                .map(str::to_owned)
        }) else {
            continue;
        };
        let src = manifest.parent().unwrap().join("src");
        if src.join("lib.rs").is_file()
            && !manifest.starts_with(root.join("examples/planner-template"))
        {
            out.push((name.replace('-', "_"), src));
        }
    }
    out
}

/// Whether `text` declares an item (or re-exports a name) `name`.
fn declares(text: &str, name: &str) -> bool {
    const KINDS: &[&str] = &[
        "struct ", "enum ", "fn ", "trait ", "type ", "const ", "static ", "mod ", "union ",
    ];
    let has_word = |line: &str, word: &str| {
        line.match_indices(word).any(|(i, _)| {
            !line[..i].ends_with(is_ident) && !line[i + word.len()..].starts_with(is_ident)
        })
    };
    text.lines().any(|line| {
        let line = line.trim_start();
        KINDS.iter().any(|k| has_word(line, &format!("{k}{name}")))
            || has_word(line, &format!("macro_rules! {name}"))
            // A re-export, or an enum variant or field declared on its own line.
            || (line.starts_with("pub use") && has_word(line, name))
            || (line.starts_with(name) && line[name.len()..].starts_with([',', ' ', '(', '{', ':']))
    })
}

/// Resolves `path` through the sources; `Err` says which segment is not found.
fn resolve(path: &str, crates: &[(String, PathBuf)], everything: &str) -> Result<(), String> {
    let mut segments = path.split("::");
    let krate = segments.next().unwrap();
    let Some((_, src)) = crates.iter().find(|(name, _)| name == krate) else {
        return Err(format!("no crate `{krate}`"));
    };
    let mut dir = src.clone();
    let mut file = src.join("lib.rs");
    let mut in_module = true;
    for segment in segments {
        if in_module {
            let (flat, nested) = (
                dir.join(format!("{segment}.rs")),
                dir.join(segment).join("mod.rs"),
            );
            if flat.is_file() || nested.is_file() {
                file = if flat.is_file() { flat } else { nested };
                dir = dir.join(segment);
                continue;
            }
            if declares(&read(&file), segment) {
                in_module = false;
                continue;
            }
            return Err(format!("`{segment}` is not declared in {}", shown(&file)));
        }
        // Past an item (a type, a re-exported module): its methods, variants and fields,
        // anywhere in the workspace.
        if !declares(everything, segment) {
            return Err(format!(
                "no item, variant or field `{segment}` in the workspace"
            ));
        }
    }
    Ok(())
}

#[test]
fn every_rust_path_in_the_docs_exists() {
    let crates = crates();
    let everything: String = sources()
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .map(|p| read(p))
        .collect::<Vec<_>>()
        .join("\n");
    let mut wrong = Vec::new();
    let mut checked = 0;
    for doc in docs() {
        for path in rust_paths(&read(&doc)) {
            checked += 1;
            if let Err(why) = resolve(&path, &crates, &everything) {
                wrong.push(format!("{}: `{path}`: {why}", shown(&doc)));
            }
        }
    }
    assert!(
        checked >= 20,
        "only {checked} paths found: is the scan broken?"
    );
    assert!(
        wrong.is_empty(),
        "paths the docs name that do not exist:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_paths_users_import_are_imports_of_this_test() {
    let this = read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/docs.rs"));
    let imported = |path: &str| {
        let (parent, last) = path.rsplit_once("::").unwrap();
        this.lines().any(|l| {
            l.trim() == format!("let _ = {path};")
                || l.starts_with("use ")
                    && (l == format!("use {path};")
                        || (l.starts_with(&format!("use {parent}::{{"))
                            && l.split(['{', '}', ',', ' ']).any(|w| w == last)))
        })
    };
    let mut missing = Vec::new();
    for doc in USER_DOCS {
        let doc = root().join(doc);
        for path in rust_paths(&read(&doc)) {
            if !path.starts_with("kvferry::") {
                missing.push(format!(
                    "{}: `{path}`: a user imports the `kvferry` crate, not its parts",
                    shown(&doc)
                ));
            } else if !imported(&path) {
                missing.push(format!(
                    "{}: `{path}` is not a `use` line of tests/docs.rs",
                    shown(&doc)
                ));
            }
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}

#[test]
fn every_environment_variable_in_the_docs_is_read_somewhere() {
    let code: String = sources()
        .iter()
        .map(|p| read(p))
        .collect::<Vec<_>>()
        .join("\n");
    let known = env_names(&code);
    let mut wrong = Vec::new();
    for doc in docs() {
        for name in env_names(&read(&doc)) {
            if !known.contains(&name) {
                wrong.push(format!("{}: `{name}`", shown(&doc)));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "names the docs give that no code reads or defines:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn every_relative_link_and_script_in_the_docs_exists() {
    let mut wrong = Vec::new();
    for doc in docs()
        .into_iter()
        .filter(|d| d.extension().is_some_and(|e| e == "md"))
    {
        let text = read(&doc);
        let base = doc.parent().unwrap();
        for (i, _) in text.match_indices("](") {
            let target = &text[i + 2..];
            let target = &target[..target.find([')', ' ']).unwrap_or(target.len())];
            let file = target.split('#').next().unwrap();
            if file.is_empty() || file.contains("://") || file.starts_with("mailto:") {
                continue;
            }
            if !base.join(file).exists() {
                wrong.push(format!("{}: link to `{target}`", shown(&doc)));
            }
        }
        for (i, _) in text.match_indices("scripts/") {
            if text[..i].ends_with(|c: char| is_ident(c) || c == '/' || c == '.') {
                continue;
            }
            let name = &text[i..];
            let end = name
                .find(|c: char| !(is_ident(c) || "/-.".contains(c)))
                .unwrap_or(name.len());
            let name = name[..end].trim_end_matches('.');
            if name.len() > "scripts/".len() && !root().join(name).exists() {
                wrong.push(format!("{}: `{name}`", shown(&doc)));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "links and scripts the docs name that do not exist:\n{}",
        wrong.join("\n")
    );
}
