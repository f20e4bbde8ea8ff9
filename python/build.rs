//! The extension module's rpath: to the UCX ucx-sys chose (`DEP_UCP_RPATH`), as for every
//! kvferry binary, so a build in the checkout loads that UCX with no `LD_LIBRARY_PATH`.
//!
//! `KVFERRY_WHEEL=1` (set by `scripts/wheel`) leaves it out: a wheel carries no path of the
//! machine it was built on. Its `kvferry/__init__.py` loads UCX from the `libucx-cu12` wheel
//! before the extension, and the dynamic loader resolves the extension's `libucp.so.0` to
//! that copy by its soname.

fn main() {
    println!("cargo:rerun-if-env-changed=KVFERRY_WHEEL");
    if std::env::var_os("KVFERRY_WHEEL").is_some_and(|v| v == "1") {
        return;
    }
    if let Some(dir) = std::env::var_os("DEP_UCP_RPATH") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.to_string_lossy());
    }
}
