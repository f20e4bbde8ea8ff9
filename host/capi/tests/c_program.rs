//! The C API from C: `tests/c/transfer.c` is compiled with the system's C compiler against
//! `include/kvferry.h` and `libkvferry_capi.so`, then run as a prefill and a decode process
//! that move three requests (one chunked, one with a cached prefix at the decode side, one
//! found only through the metadata the decode added with `kvferry_agent_add_peer`) over tcp
//! and over shm. The decode checks every byte of its pool — received rows against the
//! prefill's pattern, its cached rows and every other byte against what it wrote — and both
//! must exit 0 reporting the same byte count.
//!
//! The compiler is `$CC`, else `cc`. Without one the tests print why and pass (CI installs
//! one: `scripts/setup`).

mod support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const SECRET: &str = "the c program's shared secret";

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The C compiler, or `None` (with the reason printed) when there is none.
fn compiler() -> Option<String> {
    let cc = std::env::var("CC")
        .ok()
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "cc".into());
    match Command::new(&cc).arg("--version").output() {
        Ok(out) if out.status.success() => Some(cc),
        Ok(out) => {
            println!(
                "skipped: `{cc} --version` failed ({}); install a C compiler (scripts/setup)",
                out.status
            );
            None
        }
        Err(e) => {
            println!("skipped: no C compiler `{cc}` ({e}); install one (scripts/setup)");
            None
        }
    }
}

fn run(command: &mut Command) -> Output {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    assert!(
        out.status.success(),
        "{command:?}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Compiles `tests/c/transfer.c` into `dir`, linked against the cdylib this test was built
/// with (found through an rpath; the cdylib's own rpath finds UCX).
fn build_program(cc: &str, dir: &Path) -> PathBuf {
    let lib = support::built("libkvferry_capi.so");
    let lib_dir = lib.parent().expect("the library's directory");
    let exe = dir.join("transfer");
    run(Command::new(cc)
        .args(["-std=c11", "-D_POSIX_C_SOURCE=200809L"])
        .args(["-Wall", "-Wextra", "-Wpedantic", "-Werror", "-O1"])
        .arg("-I")
        .arg(crate_dir().join("include"))
        .arg(crate_dir().join("tests/c/transfer.c"))
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", lib_dir.display()))
        .arg("-lkvferry_capi")
        // DT_RPATH, not RUNPATH: it wins over LD_LIBRARY_PATH, which cargo sets for tests to
        // include target/<profile>/, where an older uplifted copy of the library may lie.
        .arg("-Wl,--disable-new-dtags")
        .arg(format!("-Wl,-rpath,{}", lib_dir.display())));
    exe
}

/// Waits for `child` at most `limit`, killing it past that.
fn finish(mut child: Child, name: &str, limit: Duration) -> Output {
    let deadline = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                break;
            }
        }
    }
    child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn side(exe: &Path, which: &str, endpoint: &Path, plugins: &Path, transport: &str) -> Child {
    Command::new(exe)
        .arg(which)
        .arg(endpoint)
        .arg(plugins)
        .arg(transport)
        .env("KVFERRY_TEST_SECRET", SECRET)
        // The program's rpath names the library this test was built with; nothing else may,
        // and the planners come from `plugins` (or, with "-", from beside the library) alone.
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("KVFERRY_PLUGIN_DIR")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {} {which}: {e}", exe.display()))
}

/// The report line of a side (`prefill:` or `decode:`) from its stdout, which must hold no
/// error UCX logged. UCX writes its log lines to stdout (its `UCX_LOG_FILE` default): once,
/// before the decode agent waited for its prefill rank to close its endpoint (`agent_departure`
/// in kvferry-transfer's suite), the decode's worker went first, the prefill's closing flush
/// failed, and UCX logged "error during flush: Connection reset by remote peer" there.
fn report_line(o: &Output, side: &str) -> String {
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        !stdout
            .lines()
            .any(|l| l.contains(" UCX ") && l.contains("ERROR")),
        "{side}: UCX logged an error in an orderly run:\n{stdout}"
    );
    let mut reports = stdout
        .lines()
        .filter(|l| l.starts_with(&format!("{side}: ")));
    match (reports.next(), reports.next()) {
        (Some(line), None) => line.trim().to_string(),
        _ => panic!("{side}: not one report line in its stdout:\n{stdout}"),
    }
}

/// The `bytes=N` field of a side's report line.
fn bytes_of(line: &str) -> u64 {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix("bytes="))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no bytes= in {line:?}"))
}

#[test]
fn a_c_prefill_and_a_c_decode_move_every_byte_over_tcp_and_shm() {
    let Some(cc) = compiler() else { return };
    let dir = tempfile::tempdir().unwrap();
    let exe = build_program(&cc, dir.path());
    let plugins = support::plugin_dir();
    for transport in ["tcp", "shm"] {
        let endpoint = dir.path().join(format!("endpoint-{transport}"));
        let prefill = side(&exe, "prefill", &endpoint, plugins.path(), transport);
        let decode = side(&exe, "decode", &endpoint, plugins.path(), transport);
        let limit = Duration::from_secs(60);
        let d = finish(decode, "decode", limit);
        let p = finish(prefill, "prefill", limit);
        let text = |o: &Output| {
            format!(
                "{}\n{}{}",
                o.status,
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            )
        };
        assert!(d.status.success(), "{transport} decode: {}", text(&d));
        assert!(p.status.success(), "{transport} prefill: {}", text(&p));
        let d_line = report_line(&d, "decode");
        let p_line = report_line(&p, "prefill");
        assert!(
            d_line.starts_with("decode: verified 3 requests, every byte"),
            "{transport}: {d_line}"
        );
        assert!(
            p_line.starts_with("prefill: sent 3 requests"),
            "{transport}: {p_line}"
        );
        // Rows are 64 bytes, 8 per token (2 layers × K/V × 2 heads). At least the 40 + 16 +
        // (50 - 16 cached) tokens of the prompts land; at most their 7 uncached blocks whole.
        let bytes = bytes_of(&d_line);
        assert_eq!(bytes, bytes_of(&p_line), "{transport}: {p_line} / {d_line}");
        assert!(
            (90 * 8 * 64..=7 * 16 * 8 * 64).contains(&bytes),
            "{transport}: {d_line}"
        );
        println!("{transport}: {p_line}; {d_line}");
    }
}

/// Runs a prefill and a decode of `exe` over tcp with `plugins` ("-": none named, so the
/// library looks beside itself) and returns the decode's report line.
fn move_over_tcp(exe: &Path, dir: &Path, plugins: &Path) -> String {
    let endpoint = dir.join("endpoint-installed");
    let prefill = side(exe, "prefill", &endpoint, plugins, "tcp");
    let decode = side(exe, "decode", &endpoint, plugins, "tcp");
    let limit = Duration::from_secs(60);
    let (d, p) = (
        finish(decode, "decode", limit),
        finish(prefill, "prefill", limit),
    );
    for (name, o) in [("decode", &d), ("prefill", &p)] {
        assert!(
            o.status.success(),
            "{name}: {}\n{}{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }
    report_line(&d, "decode")
}

/// `scripts/install --prefix` from this build: a C program compiled with nothing but
/// `pkg-config --cflags --libs kvferry` moves bytes with the planners the library finds beside
/// itself, the same program linked with `kvferry-static` needs no libkvferry.so, and nothing
/// installed refers back to the build (the command finds its planners and UCX under the
/// prefix too).
#[test]
fn an_installed_prefix_builds_with_pkg_config_and_moves_bytes() {
    let Some(cc) = compiler() else { return };
    let build = support::deps_dir()
        .parent()
        .expect("target/<profile>")
        .to_path_buf();
    if build.file_name().and_then(|n| n.to_str()) != Some("debug")
        || !build.join("kvferry").is_file()
    {
        println!(
            "skipped: installs the debug build of the whole workspace (`cargo build --workspace`, \
             as scripts/test does first)"
        );
        return;
    }
    for tool in ["pkg-config", "patchelf"] {
        if Command::new(tool).arg("--version").output().is_err() {
            println!("skipped: no {tool} (scripts/setup installs it)");
            return;
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("prefix");
    let repo = crate_dir().join("../..");
    run(Command::new(repo.join("scripts/install"))
        .arg("--prefix")
        .arg(&prefix)
        .args(["--debug", "--no-build"]));

    let pc = prefix.join("lib/pkgconfig");
    let build_with = |package: &str, exe: &Path| {
        let flags = run(Command::new("pkg-config")
            .args(["--cflags", "--libs", package])
            .env("PKG_CONFIG_PATH", &pc));
        let flags = String::from_utf8(flags.stdout).unwrap();
        run(Command::new(&cc)
            .args([
                "-std=c11",
                "-D_POSIX_C_SOURCE=200809L",
                "-Wall",
                "-Werror",
                "-O1",
            ])
            .arg(crate_dir().join("tests/c/transfer.c"))
            .arg("-o")
            .arg(exe)
            .args(flags.split_whitespace()));
        let ldd = run(Command::new("ldd").arg(exe));
        String::from_utf8_lossy(&ldd.stdout).into_owned()
    };
    let exe = dir.path().join("transfer");
    let needs = build_with("kvferry", &exe);
    assert!(needs.contains("libkvferry.so.0"), "{needs}");
    let line = move_over_tcp(&exe, dir.path(), Path::new("-"));
    assert!(
        line.starts_with("decode: verified 3 requests, every byte"),
        "{line}"
    );

    // `kvferry-static`: the library linked in, only UCX (and libc's) loaded at run time; a
    // static program has no library beside which to find the planners, so it names them.
    let static_dir = dir.path().join("static");
    std::fs::create_dir(&static_dir).unwrap();
    let exe = static_dir.join("transfer");
    let needs = build_with("kvferry-static", &exe);
    assert!(!needs.contains("libkvferry"), "{needs}");
    assert!(needs.contains("libucp.so"), "{needs}");
    let line = move_over_tcp(&exe, &static_dir, &prefix.join("lib/kvferry/planners"));
    assert!(
        line.starts_with("decode: verified 3 requests, every byte"),
        "{line}"
    );

    // Nothing installed points back at the build: RUNPATHs are $ORIGIN-relative (or absent,
    // for a system UCX), and the command lists the installed planners with no configuration.
    for file in ["lib/libkvferry.so", "bin/kvferry"] {
        let out = run(Command::new("readelf").arg("-d").arg(prefix.join(file)));
        let text = String::from_utf8_lossy(&out.stdout);
        for line in text
            .lines()
            .filter(|l| l.contains("RUNPATH") || l.contains("RPATH"))
        {
            assert!(line.contains("[$ORIGIN/"), "{file}: {line}");
        }
    }
    let listed = run(Command::new(prefix.join("bin/kvferry"))
        .arg("planners")
        .env_remove("KVFERRY_PLUGIN_DIR")
        .env_remove("LD_LIBRARY_PATH"));
    let listed = String::from_utf8_lossy(&listed.stdout);
    for id in ["kvferry.default", "kvferry.deepseek_mla_latent"] {
        assert!(listed.contains(id), "{listed}");
    }
}

#[test]
fn the_header_compiles_as_cpp() {
    let cxx = std::env::var("CXX")
        .ok()
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "c++".into());
    if Command::new(&cxx).arg("--version").output().is_err() {
        println!("skipped: no C++ compiler `{cxx}`");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("header.cpp");
    std::fs::write(
        &source,
        "#include \"kvferry.h\"\nstatic_assert(sizeof(kvferry_event) == 696, \"event size\");\n\
         int main() { return kvferry_agent_wake_fd(nullptr) == -1 ? 0 : 1; }\n",
    )
    .unwrap();
    run(Command::new(&cxx)
        .args(["-std=c++17", "-Wall", "-Wextra", "-Werror", "-fsyntax-only"])
        .arg("-I")
        .arg(crate_dir().join("include"))
        .arg(&source));
}
