//! Probes the system UCX with pkg-config and generates bindings for the UCP API with bindgen.
//!
//! Needs, on every build machine: the UCX development files (pkg-config package `ucx`,
//! version 1.10 or newer, for `ucp_put_nbx` and friends) and libclang for bindgen.

use std::env;
use std::path::PathBuf;

/// Oldest UCX release with the complete `*_nbx` API this crate is written against.
const MIN_UCX_VERSION: &str = "1.10";

const INSTALL_HINT: &str = "install the UCX development files, pkg-config and libclang, e.g. \
     `apt-get install libucx-dev pkg-config libclang-dev clang` on Debian/Ubuntu";

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-changed=build.rs");

    let ucx = pkg_config::Config::new()
        .atleast_version(MIN_UCX_VERSION)
        .probe("ucx")
        .unwrap_or_else(|err| {
            panic!(
                "ucx-sys: could not find UCX >= {MIN_UCX_VERSION} through pkg-config \
                 (package `ucx`): {err}\nhint: {INSTALL_HINT}"
            )
        });

    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .allowlist_function("ucp_.*")
        .allowlist_function("ucs_status_string")
        .allowlist_type("ucp_.*")
        .allowlist_type("ucs_status_t|ucs_status_ptr_t|ucs_thread_mode_t|ucs_memory_type_t")
        .allowlist_var("UCP_.*|UCS_.*")
        // `ucs_status_t` comes back from C as any integer the library chooses; a Rust enum
        // holding a value it does not list is undefined behaviour, so bind it as a newtype.
        .newtype_enum("ucs_status_t")
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(true);
    for path in &ucx.include_paths {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }

    let bindings = builder.generate().unwrap_or_else(|err| {
        panic!("ucx-sys: bindgen failed on <ucp/api/ucp.h>: {err}\nhint: {INSTALL_HINT}")
    });

    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("ucx-sys: could not write bindings.rs to OUT_DIR");
}
