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
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    let here = library_file as *const () as *const libc::c_void;
    // SAFETY: `here` is an address inside this object; `info` is writable and dladdr fills it
    // (or returns 0, leaving it unread).
    let found = unsafe { libc::dladdr(here, info.as_mut_ptr()) };
    if found == 0 {
        return None;
    }
    // SAFETY: dladdr succeeded, so it initialised `info`.
    let info = unsafe { info.assume_init() };
    if info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr's `dli_fname` is a NUL-terminated path owned by the dynamic loader,
    // valid while the object stays loaded (it is this one).
    let file = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    Some(std::path::PathBuf::from(
        <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(file.to_bytes()),
    ))
}
