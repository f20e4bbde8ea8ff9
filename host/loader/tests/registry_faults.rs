//! Loading faults: every way a file on the plugin path can be unusable is refused with the
//! exact `LoadError`, naming the file, and the process keeps running.
//!
//! The fixture libraries live in `tests/fixtures`, a cargo workspace of their own; the first
//! test that needs one builds them all (once per test binary). Garbage and truncated files are
//! made here. Each test puts its files in a temporary plugin directory.
//!
//! This binary loads libraries into the process and leaves them loaded (the registry never
//! unloads): keep it separate from tests that assume a clean process.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use kvferry_loader::{BindError, LoadError, Registry, SkippedFile};
use kvferry_planner_abi::ffi::{ROption, RVec};
use kvferry_planner_abi::{
    Deployment, ErrorKind, Mapping, PageTable, PairRequest, RankInfo, TokenRange,
};
use kvferry_testkit::conform::build_out_of_tree;
use tempfile::TempDir;

/// Builds the fixture workspace once per test binary; returns its output directory.
fn fixture_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| build_out_of_tree("tests/fixtures"))
}

/// A fixture library by crate name (`not-a-planner` → `libfixture_not_a_planner.so`).
fn fixture(name: &str) -> PathBuf {
    let file = format!("libfixture_{}.so", name.replace('-', "_"));
    let path = fixture_dir().join(file);
    assert!(path.is_file(), "fixture {} was not built", path.display());
    path
}

/// A temporary plugin directory holding `files` as `(name, contents)`.
fn plugin_dir(files: &[(&str, Vec<u8>)]) -> TempDir {
    let dir = tempfile::tempdir().expect("create a temporary plugin directory");
    for (name, bytes) in files {
        std::fs::write(dir.path().join(name), bytes).expect("write a plugin file");
    }
    dir
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// Scans one directory that should hold exactly one refused file; returns the reason.
fn only_skipped(dir: &TempDir) -> LoadError {
    let registry = Registry::scan(&[dir.path().to_path_buf()]);
    assert!(
        registry.planners().is_empty(),
        "nothing should load: {:?}",
        registry.planners()
    );
    match registry.skipped() {
        [SkippedFile { path, reason }] => {
            assert_eq!(path, reason.path());
            reason.clone()
        }
        other => panic!("expected one skipped file, got {other:?}"),
    }
}

/// Asserts the error's text names the file.
fn names_file(error: &LoadError, file: &Path) {
    let text = error.to_string();
    assert!(
        text.contains(&file.display().to_string()),
        "`{text}` does not name {}",
        file.display()
    );
    println!("{text}");
}

/// Offsets that matter for truncation, read from the ELF64 (little-endian) headers: the end
/// of the program header table, the largest end of a `PT_LOAD` segment's file range, and the
/// start and end of the section header table.
struct ElfLayout {
    ph_end: u64,
    load_end: u64,
    sh_start: u64,
    sh_end: u64,
}

fn elf_layout(bytes: &[u8]) -> ElfLayout {
    let u16_at = |at: usize| u64::from(u16::from_le_bytes([bytes[at], bytes[at + 1]]));
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
    let (phoff, shoff) = (u64_at(32), u64_at(40));
    let (phentsize, phnum) = (u16_at(54), u16_at(56));
    let (shentsize, shnum) = (u16_at(58), u16_at(60));
    let load_end = (0..phnum)
        .map(|i| (phoff + i * phentsize) as usize)
        .filter(|&at| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) == 1)
        .map(|at| u64_at(at + 8) + u64_at(at + 32))
        .max()
        .expect("a PT_LOAD segment");
    ElfLayout {
        ph_end: phoff + phnum * phentsize,
        load_end,
        sh_start: shoff,
        sh_end: shoff + shnum * shentsize,
    }
}

fn rank(instance_name: &str) -> RankInfo {
    let empty = PageTable {
        tokens_per_block: 32,
        pools: RVec::new(),
        groups: RVec::new(),
    };
    RankInfo::new(instance_name, &Mapping::SINGLE, 0, vec![1], empty)
        .with_planner("fixture.panicky")
}

fn deployment() -> Deployment {
    Deployment {
        architecture: "LlamaForCausalLM".into(),
        mapping: Mapping::SINGLE,
    }
}

#[test]
fn garbage_is_not_elf() {
    // Deterministic noise (an LCG), 5000 bytes, not starting with the ELF magic.
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let garbage: Vec<u8> = (0..5000)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 56) as u8
        })
        .collect();
    assert_ne!(&garbage[..4], b"\x7fELF");
    let dir = plugin_dir(&[("garbage.so", garbage)]);
    let error = only_skipped(&dir);
    assert!(
        matches!(&error, LoadError::NotElf { detail, .. } if detail == "bad magic"),
        "{error:?}"
    );
    names_file(&error, &dir.path().join("garbage.so"));
}

#[test]
fn elf_of_the_wrong_kind_is_refused_before_dlopen() {
    let mut bytes = read(&fixture("panicky"));
    // e_type = ET_EXEC.
    bytes[16] = 2;
    let dir = plugin_dir(&[("exec.so", bytes.clone())]);
    let error = only_skipped(&dir);
    assert!(
        matches!(&error, LoadError::NotElf { detail, .. } if detail.contains("executable")),
        "{error:?}"
    );
    names_file(&error, &dir.path().join("exec.so"));

    // e_type back to ET_DYN, e_machine = something this host is not.
    bytes[16] = 3;
    let other = if cfg!(target_arch = "aarch64") {
        62u16
    } else {
        183
    };
    bytes[18..20].copy_from_slice(&other.to_le_bytes());
    let dir = plugin_dir(&[("foreign.so", bytes)]);
    let error = only_skipped(&dir);
    assert!(
        matches!(&error, LoadError::NotElf { detail, .. } if detail.starts_with("machine")),
        "{error:?}"
    );
    names_file(&error, &dir.path().join("foreign.so"));
}

#[test]
fn truncated_copies_are_refused_naming_what_runs_past_the_end() {
    let whole = read(&fixture("panicky"));
    let layout = elf_layout(&whole);
    assert!(
        layout.load_end > 100 * 1024,
        "the fixture is too small to cut a PT_LOAD segment at 100 KB"
    );
    assert!(
        layout.sh_start >= layout.load_end,
        "section headers after the segments"
    );

    let cases: [(&str, usize, &str); 5] = [
        ("40 bytes", 40, "ELF header"),
        ("100 bytes", 100, "program header table"),
        ("100 KB", 100 * 1024, "PT_LOAD segment"),
        (
            "one byte short of the last segment",
            layout.load_end as usize - 1,
            "PT_LOAD",
        ),
        (
            "inside the section header table",
            (layout.sh_start + (layout.sh_end - layout.sh_start) / 2) as usize,
            "section header table",
        ),
    ];
    assert!(layout.ph_end > 100);
    for (what, size, part_expected) in cases {
        let dir = plugin_dir(&[("libtruncated.so", whole[..size].to_vec())]);
        let error = only_skipped(&dir);
        match &error {
            LoadError::Truncated {
                part,
                end,
                file_size,
                ..
            } => {
                assert!(
                    part.starts_with(part_expected),
                    "{what}: `{part}` should start with `{part_expected}`"
                );
                assert_eq!(*file_size, size as u64, "{what}");
                assert!(*end > *file_size, "{what}");
            }
            other => panic!("{what}: expected Truncated, got {other:?}"),
        }
        names_file(&error, &dir.path().join("libtruncated.so"));
    }
    // Still here: no SIGBUS inside dlopen.
}

/// The offsets in the file of the `PT_LOAD` program headers, with their index in the table.
fn load_headers(bytes: &[u8]) -> Vec<(usize, usize)> {
    let u16_at = |at: usize| usize::from(u16::from_le_bytes([bytes[at], bytes[at + 1]]));
    let phoff = u64::from_le_bytes(bytes[32..40].try_into().unwrap()) as usize;
    (0..u16_at(56))
        .map(|i| (i, phoff + i * u16_at(54)))
        .filter(|&(_, at)| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) == 1)
        .collect()
}

/// Scans a directory holding only `bytes` as `name`; returns the reason it was refused,
/// after checking that the reason names the file.
fn refused(name: &str, bytes: Vec<u8>) -> LoadError {
    let dir = plugin_dir(&[(name, bytes)]);
    let error = only_skipped(&dir);
    names_file(&error, &dir.path().join(name));
    error
}

#[test]
fn whole_files_whose_headers_point_past_the_end_are_refused() {
    let whole = read(&fixture("panicky"));
    let size = whole.len() as u64;
    let loads = load_headers(&whole);
    assert!(loads.len() >= 2, "the fixture has several PT_LOAD segments");

    // The first PT_LOAD segment's file size grown past the end of the file; every header
    // table is intact, so only the segment check can catch it.
    let (index, at) = loads[0];
    let offset = u64::from_le_bytes(whole[at + 8..at + 16].try_into().unwrap());
    let mut bytes = whole.clone();
    bytes[at + 32..at + 40].copy_from_slice(&(size - offset + 1).to_le_bytes());
    let error = refused("libgrown_segment.so", bytes);
    assert_eq!(
        error,
        LoadError::Truncated {
            path: error.path().to_path_buf(),
            part: format!("PT_LOAD segment {index}"),
            end: size + 1,
            file_size: size,
        }
    );

    // A segment whose offset + size does not fit in 64 bits (the first segment starts at
    // offset 0, so take the second).
    let (index, at) = loads[1];
    assert_ne!(
        u64::from_le_bytes(whole[at + 8..at + 16].try_into().unwrap()),
        0
    );
    let mut bytes = whole.clone();
    bytes[at + 32..at + 40].copy_from_slice(&u64::MAX.to_le_bytes());
    let error = refused("liboverflowing_segment.so", bytes);
    assert!(
        matches!(&error, LoadError::NotElf { detail, .. }
            if detail.contains(&format!("PT_LOAD segment {index}"))
                && detail.contains("overflows")),
        "{error:?}"
    );

    // The program header table moved to the last bytes of the file.
    let mut bytes = whole.clone();
    bytes[32..40].copy_from_slice(&(size - 8).to_le_bytes());
    let error = refused("libmoved_phdrs.so", bytes);
    assert!(
        matches!(&error, LoadError::Truncated { part, file_size, end, .. }
            if part == "program header table" && *file_size == size && *end > size),
        "{error:?}"
    );

    // The section header table moved to the last bytes of the file.
    let mut bytes = whole.clone();
    bytes[40..48].copy_from_slice(&(size - 8).to_le_bytes());
    let error = refused("libmoved_shdrs.so", bytes);
    assert!(
        matches!(&error, LoadError::Truncated { part, file_size, end, .. }
            if part == "section header table" && *file_size == size && *end > size),
        "{error:?}"
    );

    // The same, with e_phnum = PN_XNUM: the program header count is in section 0, which
    // is read first.
    let mut bytes = whole;
    bytes[40..48].copy_from_slice(&(size - 8).to_le_bytes());
    bytes[56..58].copy_from_slice(&0xffff_u16.to_le_bytes());
    let error = refused("libmoved_section0.so", bytes);
    assert!(
        matches!(&error, LoadError::Truncated { part, file_size, end, .. }
            if part == "section header table" && *file_size == size && *end == size - 8 + 64),
        "{error:?}"
    );
}

#[test]
fn malformed_identification_is_not_elf() {
    let whole = read(&fixture("panicky"));
    let not_elf = |name: &str, edit: &dyn Fn(&mut Vec<u8>)| {
        let mut bytes = whole.clone();
        edit(&mut bytes);
        match refused(name, bytes) {
            LoadError::NotElf { detail, .. } => detail,
            other => panic!("{name}: expected NotElf, got {other:?}"),
        }
    };

    assert_eq!(not_elf("short.so", &|b| b.truncate(3)), "bad magic");
    assert_eq!(
        not_elf("elf32.so", &|b| b[4] = 1),
        "ELF class 1, expected 64-bit (2)"
    );
    assert_eq!(
        not_elf("no_byte_order.so", &|b| b[5] = 7),
        "unknown byte order 7"
    );
    let other_order = if cfg!(target_endian = "little") {
        "big-endian byte order, this host is little-endian"
    } else {
        "little-endian byte order, this host is big-endian"
    };
    assert_eq!(not_elf("other_order.so", &|b| b[5] = 3 - b[5]), other_order);
    // EI_VERSION = EV_NONE (dlopen refuses it too).
    assert_eq!(
        not_elf("version0.so", &|b| b[6] = 0),
        "ELF version 0, expected 1"
    );
    // e_phnum = 0.
    assert_eq!(
        not_elf("no_phdrs.so", &|b| b[56..58].fill(0)),
        "no program headers"
    );
    // e_phentsize and e_shentsize other than the ELF64 sizes (56 and 64).
    let detail = not_elf("phentsize.so", &|b| {
        b[54..56].copy_from_slice(&57u16.to_le_bytes())
    });
    assert!(
        detail.starts_with("program header table:") && detail.ends_with("(entry size 57)"),
        "{detail}"
    );
    let detail = not_elf("shentsize.so", &|b| {
        b[58..60].copy_from_slice(&40u16.to_le_bytes())
    });
    assert!(
        detail.starts_with("section header table:") && detail.ends_with("(entry size 40)"),
        "{detail}"
    );
}

#[test]
fn a_library_with_a_missing_dependency_fails_to_open() {
    // Rename the library's DT_NEEDED `libc.so.6` to a library that does not exist.
    let mut bytes = read(&fixture("panicky"));
    let needle = b"libc.so.6\0";
    let mut replaced = 0;
    for at in 0..bytes.len() - needle.len() {
        if &bytes[at..at + needle.len()] == needle {
            bytes[at..at + needle.len()].copy_from_slice(b"libq.so.6\0");
            replaced += 1;
        }
    }
    assert!(replaced > 0, "the fixture names libc.so.6");
    let dir = plugin_dir(&[("libmissing_dep.so", bytes)]);
    let error = only_skipped(&dir);
    assert!(
        matches!(&error, LoadError::Open { message, .. } if message.contains("libq.so.6")),
        "{error:?}"
    );
    names_file(&error, &dir.path().join("libmissing_dep.so"));
}

#[test]
fn a_library_without_a_root_module_is_not_a_planner() {
    let dir = plugin_dir(&[("libnot_a_planner.so", read(&fixture("not-a-planner")))]);
    let error = only_skipped(&dir);
    assert!(
        matches!(&error, LoadError::NotAPlanner { symbol, .. }
            if symbol == "_1as_0lib_1header_0root_bmodule_bloader"),
        "{error:?}"
    );
    names_file(&error, &dir.path().join("libnot_a_planner.so"));
}

#[test]
fn a_skewed_root_module_is_an_abi_mismatch_with_a_short_summary() {
    let dir = plugin_dir(&[("libskewed_abi.so", read(&fixture("skewed-abi")))]);
    let error = only_skipped(&dir);
    let LoadError::AbiMismatch { summary, .. } = &error else {
        panic!("expected AbiMismatch, got {error:?}");
    };
    assert!(!summary.is_empty() && summary.len() <= 11, "{summary:#?}");
    // The fixture retypes `version` (RString → u32) and adds `priority`.
    assert!(
        summary
            .iter()
            .any(|l| l == "mismatched type (expected RString, found u32)"),
        "{summary:#?}"
    );
    assert!(
        summary
            .iter()
            .any(|l| l.starts_with("unexpected field") && l.contains("priority")),
        "{summary:#?}"
    );
    let text = error.to_string();
    assert!(text.len() < 2000, "{} bytes: {text}", text.len());
    names_file(&error, &dir.path().join("libskewed_abi.so"));
}

#[test]
fn an_old_interface_version_is_incompatible() {
    let dir = plugin_dir(&[("libversion_skew.so", read(&fixture("version-skew")))]);
    let error = only_skipped(&dir);
    assert!(
        matches!(&error, LoadError::IncompatibleVersion { expected, found, .. }
            if expected.starts_with("0.2.") && found == "0.0.1"),
        "{error:?}"
    );
    names_file(&error, &dir.path().join("libversion_skew.so"));
}

#[test]
fn a_failing_root_module_constructor_is_init_failed() {
    let dir = plugin_dir(&[("libinit_fails.so", read(&fixture("init-fails")))]);
    let error = only_skipped(&dir);
    assert!(
        matches!(&error, LoadError::InitFailed { message, .. }
            if message.contains("fixture.init_fails: no planner today")),
        "{error:?}"
    );
    names_file(&error, &dir.path().join("libinit_fails.so"));
}

#[test]
fn a_panicking_root_module_constructor_is_init_panicked() {
    let dir = plugin_dir(&[("libinit_panics.so", read(&fixture("init-panics")))]);
    let error = only_skipped(&dir);
    assert!(
        matches!(&error, LoadError::InitPanicked { .. }),
        "{error:?}"
    );
    names_file(&error, &dir.path().join("libinit_panics.so"));
}

#[test]
fn the_second_file_with_an_id_is_refused_naming_both() {
    let bytes = read(&fixture("panicky"));
    let dir = plugin_dir(&[("liba.so", bytes.clone()), ("libb.so", bytes)]);
    let registry = Registry::scan(&[dir.path().to_path_buf()]);
    let (a, b) = (dir.path().join("liba.so"), dir.path().join("libb.so"));
    assert_eq!(registry.planners().len(), 1);
    assert_eq!(registry.planners()[0].id, "fixture.panicky");
    assert_eq!(registry.planners()[0].path, a);
    let [skipped] = registry.skipped() else {
        panic!("expected one skipped file: {:?}", registry.skipped());
    };
    assert_eq!(
        skipped.reason,
        LoadError::DuplicateId {
            id: "fixture.panicky".into(),
            first: a.clone(),
            second: b.clone(),
        }
    );
    assert_eq!(skipped.path, b);
    let text = skipped.reason.to_string();
    assert!(text.contains(&a.display().to_string()) && text.contains(&b.display().to_string()));
    println!("{text}");
}

#[test]
fn the_same_directory_twice_loads_each_file_once() {
    let dir = plugin_dir(&[("libpanicky.so", read(&fixture("panicky")))]);
    let registry = Registry::scan(&[dir.path().to_path_buf(), dir.path().to_path_buf()]);
    assert_eq!(registry.planners().len(), 1);
    assert!(registry.skipped().is_empty(), "{:?}", registry.skipped());
}

#[test]
fn a_missing_directory_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-dir");
    let registry = Registry::scan(std::slice::from_ref(&missing));
    let [skipped] = registry.skipped() else {
        panic!("expected one skipped entry: {:?}", registry.skipped());
    };
    assert!(
        matches!(&skipped.reason, LoadError::Read { path, .. } if *path == missing),
        "{:?}",
        skipped.reason
    );
    println!("{}", skipped.reason);
}

#[test]
fn every_fault_in_one_directory_leaves_the_good_planner_usable() {
    let panicky = read(&fixture("panicky"));
    let dir = plugin_dir(&[
        ("garbage.so", vec![0u8; 5000]),
        ("libtruncated.so", panicky[..100 * 1024].to_vec()),
        ("libnot_a_planner.so", read(&fixture("not-a-planner"))),
        ("libskewed_abi.so", read(&fixture("skewed-abi"))),
        ("libversion_skew.so", read(&fixture("version-skew"))),
        ("libinit_fails.so", read(&fixture("init-fails"))),
        ("libinit_panics.so", read(&fixture("init-panics"))),
        ("libpanicky.so", panicky.clone()),
        ("libpanicky_copy.so", panicky),
        ("README.txt", b"not a plugin".to_vec()),
    ]);
    let registry = Registry::scan(&[dir.path().to_path_buf()]);
    let ids: Vec<&str> = registry.planners().iter().map(|p| p.id.as_str()).collect();
    assert_eq!(ids, ["fixture.panicky"]);
    let kinds: Vec<&str> = registry
        .skipped()
        .iter()
        .map(|s| match s.reason {
            LoadError::NotElf { .. } => "not_elf",
            LoadError::Truncated { .. } => "truncated",
            LoadError::NotAPlanner { .. } => "not_a_planner",
            LoadError::AbiMismatch { .. } => "abi_mismatch",
            LoadError::IncompatibleVersion { .. } => "incompatible_version",
            LoadError::InitFailed { .. } => "init_failed",
            LoadError::InitPanicked { .. } => "init_panicked",
            LoadError::DuplicateId { .. } => "duplicate_id",
            _ => "other",
        })
        .collect();
    // Files by name: garbage, libinit_fails, libinit_panics, libnot_a_planner, libpanicky,
    // libpanicky_copy, libskewed_abi, libtruncated, libversion_skew.
    assert_eq!(
        kinds,
        [
            "not_elf",
            "init_failed",
            "init_panicked",
            "not_a_planner",
            "duplicate_id",
            "abi_mismatch",
            "truncated",
            "incompatible_version",
        ]
    );
    let json = serde_json::to_value(registry.skipped()).unwrap();
    assert_eq!(json[0]["reason"]["kind"], "not_elf");
    assert!(json[0]["message"].as_str().unwrap().contains("garbage.so"));

    // Unknown ids list the known ones and point at the skipped files.
    let error = registry.bind("acme.nope", &deployment()).unwrap_err();
    assert!(
        matches!(error, BindError::UnknownPlanner { .. }),
        "{error:?}"
    );
    let text = error.to_string();
    assert!(text.contains("fixture.panicky"), "{text}");
    assert!(
        text.contains("8 files were skipped, see `kvferry planners --all`"),
        "{text}"
    );
    println!("{text}");

    let bound = registry.bind("fixture.panicky", &deployment()).unwrap();
    let planner = bound.instantiate(&rank("ctx")).unwrap();
    assert_eq!(
        planner
            .targets(&rank("ctx"), &rank("gen"), 0)
            .unwrap()
            .ranks
            .len(),
        1
    );
}

#[test]
fn planner_panics_come_back_as_errors() {
    let dir = plugin_dir(&[("libpanicky.so", read(&fixture("panicky")))]);
    let registry = Registry::scan(&[dir.path().to_path_buf()]);
    let bound = registry.bind("fixture.panicky", &deployment()).unwrap();
    assert_eq!(bound.id(), "fixture.panicky");
    assert_eq!(
        bound.describer_id(),
        kvferry_planner_abi::DEFAULT_DESCRIBER_ID
    );
    assert_eq!(bound.version(), "0.1.0");
    assert_eq!(bound.path(), dir.path().join("libpanicky.so"));

    // A panic in the constructor.
    let error = bound
        .instantiate(&rank("ctx-panic-new-0"))
        .err()
        .expect("new_planner panics for panic-new");
    assert_eq!(error.kind(), ErrorKind::PANICKED);
    assert!(error.message().contains("new_planner panicked"), "{error}");
    println!("{error}");

    // A panic in pair; the planner object stays usable.
    let (me, peer) = (rank("ctx"), rank("gen"));
    let planner = bound.instantiate(&me).unwrap();
    let request = PairRequest {
        token_range: TokenRange { start: 0, end: 64 },
        prompt_len: 64,
        dst_start_token: ROption::RNone,
        is_last: true,
    };
    for _ in 0..2 {
        let error = planner.pair(&me, &peer, &[], &[], &request).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::PANICKED);
        assert!(error.message().contains("pair always panics"), "{error}");
    }
    println!(
        "{}",
        planner.pair(&me, &peer, &[], &[], &request).unwrap_err()
    );
    let targets = planner.targets(&me, &peer, 0).unwrap();
    assert_eq!(targets.ranks.as_slice(), &[0]);
    planner.check_peer(&me, &peer).unwrap();
}

/// The in-tree planners, if the main workspace has built their `.so` files (`cargo build`
/// puts them in `target/<profile>`, next to the `kvferry` binary; this test binary lives in
/// `target/<profile>/deps`). Skipped, with a note, when none is there yet.
#[test]
fn in_tree_planners_load_when_built() {
    let exe = std::env::current_exe().expect("the test binary's path");
    let Some(profile_dir) = exe.parent().and_then(Path::parent) else {
        return;
    };
    let mut built: Vec<PathBuf> = std::fs::read_dir(profile_dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("libkvferry_planner_") && n.ends_with(".so"))
                })
                .collect()
        })
        .unwrap_or_default();
    built.sort();
    if built.is_empty() {
        println!(
            "no in-tree planner .so in {}; run `cargo build` to include them",
            profile_dir.display()
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for so in &built {
        std::fs::copy(so, dir.path().join(so.file_name().unwrap())).unwrap();
    }
    let registry = Registry::scan(&[dir.path().to_path_buf()]);
    assert!(registry.skipped().is_empty(), "{:#?}", registry.skipped());
    assert_eq!(registry.planners().len(), built.len());
    for info in registry.planners() {
        assert!(info.id.starts_with("kvferry."), "{info}");
        println!("{info}");
    }
}
