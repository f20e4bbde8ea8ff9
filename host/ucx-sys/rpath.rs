//! The build script of every crate that links executables, test binaries or shared libraries
//! against UCX (`build = "../ucx-sys/rpath.rs"`, or a `build.rs` linked to this file in the
//! crates that are published, next to a direct `ucx-sys` dependency): an
//! rpath to the library directory `ucx-sys` chose (`DEP_UCP_RPATH`), so they load the UCX they
//! were built against with no `LD_LIBRARY_PATH`. One file for all of them; `ucx-sys`'s own
//! `build.rs` documents the choice.

fn main() {
    if let Some(dir) = std::env::var_os("DEP_UCP_RPATH") {
        let dir = dir.to_string_lossy();
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
