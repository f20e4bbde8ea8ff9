//! Where an installed kvferry finds its planners: beside the library (or executable) this code
//! was linked into.

/// Where an agent whose configuration names no `plugin_dir` loads planners from:
/// `KVFERRY_PLUGIN_DIR` (colon-separated) when set, else the planners installed with this
/// library ([`installed_planners`]); empty when neither is there.
pub fn default_plugin_dirs() -> Vec<std::path::PathBuf> {
    let env = std::env::var_os(kvferry_loader::PLUGIN_DIR_ENV).unwrap_or_default();
    let dirs: Vec<std::path::PathBuf> = std::env::split_paths(&env)
        .filter(|p| !p.as_os_str().is_empty())
        .collect();
    if dirs.is_empty() {
        installed_planners().into_iter().collect()
    } else {
        dirs
    }
}

/// The planners installed with this library, found beside the file it was loaded from:
/// `kvferry/planners` (`scripts/install` puts the library at `PREFIX/lib/libkvferry.so` and
/// the planners at `PREFIX/lib/kvferry/planners`) or `planners` (the Python wheel: the
/// extension at `kvferry/_kvferry.abi3.so`, the planners at `kvferry/planners`), the first
/// that exists. Linked statically, the "library" is the executable, and its directory is
/// looked in alike.
pub fn installed_planners() -> Option<std::path::PathBuf> {
    let file = library_file()?;
    let dir = file.parent()?;
    // `lib/kvferry/planners` seen from `lib/`.
    let beside_lib = std::path::Path::new(kvferry_loader::INSTALLED_PLANNERS)
        .strip_prefix("lib")
        .ok()?;
    [dir.join(beside_lib), dir.join("planners")]
        .into_iter()
        .find(|d| d.is_dir())
}

/// The file this library was loaded from (the executable, when linked statically).
pub fn library_file() -> Option<std::path::PathBuf> {
    kvferry_platform::object_file_of(library_file as *const ())
}
