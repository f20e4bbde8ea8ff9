//! Chooses the UCX to build against, links it, and generates bindings for the UCP API with
//! bindgen.
//!
//! One rule, in order (the first that applies wins; README "Which UCX"):
//!
//! 1. `KVFERRY_UCX_DIR`: an installed UCX prefix (`include/ucp/api/ucp.h` and `libucp.so` under
//!    `lib/`, `lib64/` or `lib/<multiarch>/`). `KVFERRY_UCX_DIR=/usr` is Debian's `libucx-dev`;
//!    an HPC-X, DOCA-OFED or NIXL-bundled UCX is named the same way.
//! 2. The `libucx-cu12` wheel that `scripts/setup` unpacks into the workspace's `.ucx/libucx`
//!    (UCX 1.22, multi-threaded, with the CUDA transports).
//! 3. The system's `pkg-config ucx`.
//!
//! The chosen library directory is published to dependents as `DEP_UCP_RPATH` (this crate
//! `links = "ucp"`); the crates that link executables or test binaries turn it into an rpath
//! (`-Wl,-rpath`), so they load the same UCX at run time with no `LD_LIBRARY_PATH`. It is a
//! `RUNPATH`, so `LD_LIBRARY_PATH` still overrides it, and a process that has already loaded a
//! `libucp.so.0` (an engine, NIXL built against a shared UCX) keeps that one: the dynamic
//! loader resolves a library by its soname before searching any path.
//!
//! Needs libclang for bindgen on every build machine.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

/// Oldest UCX release with the complete `*_nbx` API this crate is written against.
const MIN_UCX: (u32, u32) = (1, 10);

const INSTALL_HINT: &str = "run `scripts/setup` (it unpacks UCX 1.22 into .ucx/), or set \
     KVFERRY_UCX_DIR to a UCX prefix, or install the system's UCX development files and \
     libclang (`apt-get install libucx-dev pkg-config libclang-dev clang` on Debian/Ubuntu)";

/// Where a UCX was found, and why that one.
struct Ucx {
    source: &'static str,
    include: Vec<PathBuf>,
    lib_dir: PathBuf,
}

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=KVFERRY_UCX_DIR");

    let ucx = choose();
    let (major, minor) = header_version(&ucx.include).unwrap_or_else(|| {
        panic!(
            "ucx-sys: no readable <ucp/api/ucp_version.h> under {:?} ({}); hint: {INSTALL_HINT}",
            ucx.include, ucx.source
        )
    });
    if (major, minor) < MIN_UCX {
        panic!(
            "ucx-sys: UCX {major}.{minor} from {} ({}) is older than {}.{}, the first \
             release with the complete *_nbx API; hint: {INSTALL_HINT}",
            ucx.lib_dir.display(),
            ucx.source,
            MIN_UCX.0,
            MIN_UCX.1
        );
    }
    println!("cargo:rustc-link-search=native={}", ucx.lib_dir.display());
    // `ucs_status_string` lives in libucs, everything else bound here in libucp.
    println!("cargo:rustc-link-lib=dylib=ucp");
    println!("cargo:rustc-link-lib=dylib=ucs");
    println!("cargo:rpath={}", ucx.lib_dir.display());
    // This crate's own tests; dependents add theirs through `rpath.rs`.
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", ucx.lib_dir.display());
    println!("cargo:version={major}.{minor}");
    println!("cargo:source={}", ucx.source);
    // For `kvferry doctor`: what this build was linked against, to compare with what a
    // process actually loaded.
    println!(
        "cargo:rustc-env=KVFERRY_UCX_LINKED_DIR={}",
        ucx.lib_dir.display()
    );
    println!("cargo:rustc-env=KVFERRY_UCX_LINKED_SOURCE={}", ucx.source);
    println!("cargo:rustc-env=KVFERRY_UCX_LINKED_VERSION={major}.{minor}");

    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .parse_callbacks(Box::new(CommentsAsText))
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
    for path in &ucx.include {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }

    let bindings = builder.generate().unwrap_or_else(|err| {
        panic!(
            "ucx-sys: bindgen failed on <ucp/api/ucp.h> from {:?}: {err}\nhint: {INSTALL_HINT}",
            ucx.include
        )
    });

    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("ucx-sys: could not write bindings.rs to OUT_DIR");
}

/// Keeps UCX's Doxygen comments as documentation but never as doctests: newer headers (1.22)
/// indent code examples, which rustdoc would compile as Rust.
#[derive(Debug)]
struct CommentsAsText;

impl bindgen::callbacks::ParseCallbacks for CommentsAsText {
    fn process_comment(&self, comment: &str) -> Option<String> {
        Some(format!("~~~~text\n{comment}\n~~~~"))
    }
}

fn choose() -> Ucx {
    if let Some(dir) = env::var_os("KVFERRY_UCX_DIR").filter(|d| !d.is_empty()) {
        let dir = PathBuf::from(dir);
        return prefix(&dir, "KVFERRY_UCX_DIR").unwrap_or_else(|why| {
            panic!(
                "ucx-sys: KVFERRY_UCX_DIR={} is not a UCX prefix: {why}",
                dir.display()
            )
        });
    }
    // The workspace's unpacked wheel: `.ucx/` at the workspace root (two levels above this
    // crate). The folder is checked in empty, so watching it is cheap and rebuilds the
    // bindings when `scripts/setup` unpacks or replaces the wheel.
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let dot_ucx = manifest.join("../../.ucx");
    let dot_ucx = fs::canonicalize(&dot_ucx).unwrap_or(dot_ucx);
    if dot_ucx.is_dir() {
        println!("cargo:rerun-if-changed={}", dot_ucx.display());
        let wheel = dot_ucx.join("libucx");
        if wheel.is_dir() {
            return prefix(&wheel, "the libucx-cu12 wheel in .ucx/").unwrap_or_else(|why| {
                panic!(
                    "ucx-sys: {} is damaged ({why}); rerun scripts/setup",
                    wheel.display()
                )
            });
        }
    }
    if dot_ucx.is_dir() {
        println!(
            "cargo:warning=ucx-sys: .ucx/libucx is missing, building against the system UCX \
             (pkg-config); run scripts/setup for UCX 1.22"
        );
    }
    let found = pkg_config::Config::new()
        .cargo_metadata(false)
        .probe("ucx")
        .unwrap_or_else(|err| {
            panic!(
                "ucx-sys: no UCX: KVFERRY_UCX_DIR is unset, .ucx/libucx does not exist and \
                 pkg-config found no package `ucx`: {err}\nhint: {INSTALL_HINT}"
            )
        });
    let lib_dir = found
        .link_paths
        .first()
        .cloned()
        .or_else(|| {
            pkg_config::get_variable("ucx", "libdir")
                .ok()
                .map(PathBuf::from)
        })
        .unwrap_or_else(|| panic!("ucx-sys: pkg-config gave no library directory for ucx"));
    let mut include = found.include_paths;
    if include.is_empty() {
        include.push(PathBuf::from("/usr/include"));
    }
    Ucx {
        source: "pkg-config ucx",
        include,
        lib_dir,
    }
}

/// A UCX installed under `dir`, or what is missing there.
fn prefix(dir: &Path, source: &'static str) -> Result<Ucx, String> {
    let include = dir.join("include");
    if !include.join("ucp/api/ucp.h").is_file() {
        return Err(format!("no {}", include.join("ucp/api/ucp.h").display()));
    }
    let mut candidates = vec![dir.join("lib"), dir.join("lib64")];
    // Debian's multiarch layout (`/usr/lib/x86_64-linux-gnu`).
    if let Ok(entries) = fs::read_dir(dir.join("lib")) {
        let mut nested: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_dir())
            .collect();
        nested.sort();
        candidates.extend(nested);
    }
    let lib_dir = candidates
        .into_iter()
        .find(|d| d.join("libucp.so").exists())
        .ok_or_else(|| format!("no libucp.so under {}/lib, lib64 or lib/*", dir.display()))?;
    Ok(Ucx {
        source,
        include: vec![include],
        lib_dir,
    })
}

/// `UCP_API_MAJOR` and `UCP_API_MINOR` from the first include directory that has
/// `ucp/api/ucp_version.h` (the release number is only known at run time: `ucp_get_version`).
fn header_version(include: &[PathBuf]) -> Option<(u32, u32)> {
    let text = include
        .iter()
        .find_map(|dir| fs::read_to_string(dir.join("ucp/api/ucp_version.h")).ok())?;
    let define = |name: &str| -> Option<u32> {
        text.lines().find_map(|line| {
            let mut words = line.split_whitespace();
            (words.next() == Some("#define") && words.next() == Some(name))
                .then(|| words.next()?.trim_end_matches('U').parse().ok())
                .flatten()
        })
    };
    Some((define("UCP_API_MAJOR")?, define("UCP_API_MINOR")?))
}
