//! `scripts/gpu-check-run` (a gpu-check bundle's `run`) decides "no GPU" and "fail" as it
//! says, on this machine: without any sign of a GPU it exits 77 before running anything; with a
//! stub `nvidia-smi` listing a GPU but no usable libcuda it fails — never skips — and says why.
//! On a machine with a real GPU or driver both checks print why they do not apply.

use crate::support;

use std::fs;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/gpu-check-run")
}

/// Whether this machine shows a GPU the way the script looks for one (ignoring `nvidia-smi`,
/// which the tests keep off `PATH`).
fn gpu_here() -> bool {
    let any = |dir: &str, prefix: &str| {
        fs::read_dir(dir).is_ok_and(|entries| {
            entries
                .filter_map(Result::ok)
                .any(|e| e.file_name().to_string_lossy().starts_with(prefix))
        })
    };
    Path::new("/proc/driver/nvidia").exists() || any("/dev", "nvidia")
}

/// Whether kvferry could load libcuda here (a build without the `cuda` feature cannot tell).
fn driver_here() -> bool {
    #[cfg(feature = "cuda")]
    return kvferry_transfer::harness::cuda::driver_present();
    #[cfg(not(feature = "cuda"))]
    false
}

/// Runs `run` with `path_dirs` first on a `PATH` of the system folders only.
fn run(run: &Path, path_dirs: &[&Path], logs: &Path) -> Output {
    let mut path: Vec<PathBuf> = path_dirs.iter().map(|d| d.to_path_buf()).collect();
    path.extend(["/usr/bin", "/bin"].map(PathBuf::from));
    Command::new("bash")
        .arg(run)
        .env("PATH", std::env::join_paths(path).unwrap())
        .env("KVFERRY_GPU_CHECK_LOGS", logs)
        .env("KVFERRY_GPU_CHECK_STEP_TIMEOUT", "60")
        .env_remove("KVFERRY_GPU_TESTS")
        .output()
        .expect("run bash")
}

#[test]
fn without_a_gpu_the_run_exits_77_and_says_no_gpu() {
    if gpu_here() {
        println!("not applicable: this machine shows a GPU");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = run(&script(), &[], tmp.path());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(77), "{stdout}");
    assert!(
        stdout.starts_with("gpu-check: SKIP (no GPU on this machine: no /dev/nvidia*,"),
        "{stdout}"
    );
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
}

/// A bundle-shaped folder (this build's `kvferry` and planners, no test binaries), a stub
/// `nvidia-smi` that lists a GPU, and no libcuda: every step that needs the GPU fails, the
/// doctor step names the missing libcuda, and the verdict is FAIL (exit 1), not SKIP.
#[test]
fn gpus_listed_without_libcuda_fail() {
    if gpu_here() || driver_here() {
        println!("not applicable: this machine has a GPU or a CUDA driver");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let bundle = tmp.path().join("bundle");
    fs::create_dir_all(bundle.join("bin")).unwrap();
    fs::copy(script(), bundle.join("run")).unwrap();
    let exe = support::kvferry_exe();
    symlink(&exe, bundle.join("bin/kvferry")).unwrap();
    for planner in fs::read_dir(exe.parent().unwrap()).unwrap().flatten() {
        let name = planner.file_name();
        if name.to_string_lossy().starts_with("libkvferry_planner_") {
            symlink(planner.path(), bundle.join("bin").join(&name)).unwrap();
        }
    }
    let stubs = tmp.path().join("stubs");
    fs::create_dir_all(&stubs).unwrap();
    let smi = stubs.join("nvidia-smi");
    fs::write(
        &smi,
        "#!/bin/sh\necho 'GPU 0: NVIDIA Stub (UUID: GPU-stub)'\n",
    )
    .unwrap();
    fs::set_permissions(&smi, fs::Permissions::from_mode(0o755)).unwrap();

    let out = run(&bundle.join("run"), &[&stubs], &tmp.path().join("logs"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("gpu-check: GPU seen: nvidia-smi lists 1 GPU(s)"),
        "{stdout}"
    );
    let doctor = stdout
        .lines()
        .find(|l| l.starts_with("gpu-check: step doctor: "))
        .unwrap_or_else(|| panic!("no doctor step: {stdout}"));
    assert!(doctor.contains("FAIL"), "{doctor}");
    if cfg!(feature = "cuda") {
        assert!(
            doctor.contains(
                "GPUs are listed (nvidia-smi lists 1 GPU(s)) but libcuda cannot be loaded"
            ),
            "{doctor}"
        );
    }
    for step in ["demo-cuda-shm", "demo-cuda-tcp", "cuda-unit-tests"] {
        assert!(
            stdout.contains(&format!("gpu-check: step {step}: FAIL")),
            "{step}: {stdout}"
        );
    }
    assert!(!stdout.contains(": PASS ("), "{stdout}");
    let last = stdout.lines().last().unwrap_or_default();
    assert!(last.starts_with("gpu-check: FAIL ("), "{last}");
    assert!(!stdout.contains("gpu-check: SKIP"), "{stdout}");
}
