//! Shared by the C API's tests: where cargo put the libraries they need, and a plugin
//! directory holding only the default planner.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// `target/<profile>/deps`, the directory of the running test binary.
pub fn deps_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.parent()
        .expect("the test binary's directory")
        .to_path_buf()
}

/// A build output named `file`: in `deps/` (where cargo builds a library that is a
/// dependency of this test) or next to it in `target/<profile>/` (where it is uplifted when
/// built as a root unit).
pub fn built(file: &str) -> PathBuf {
    let deps = deps_dir();
    let candidates = [deps.join(file), deps.parent().unwrap_or(&deps).join(file)];
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "{file} is missing from {} and its parent: build it first (`cargo build -p \
                 kvferry-capi`; the default planner's cdylib comes with its tests' build)",
                deps.display()
            )
        })
}

/// A temporary plugin directory with a copy of the default planner's `.so` and nothing else
/// (a build directory holds every other `.so` too, and every one in a plugin directory is
/// loaded).
pub fn plugin_dir() -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("kvferry-capi-plugins-")
        .tempdir()
        .expect("a temporary plugin directory");
    let lib = "libkvferry_planner_default.so";
    std::fs::copy(built(lib), dir.path().join(lib)).expect("copy the default planner");
    dir
}

/// `path` as JSON string contents (the test paths have no quotes or backslashes).
pub fn json_path(path: &Path) -> String {
    let s = path.display().to_string();
    assert!(!s.contains(['"', '\\']), "{s}");
    s
}
