//! CUDA device pools on a real GPU (`--features cuda`).
//!
//! Without the CUDA driver every test prints `skipped: no CUDA driver (libcuda not found)` and
//! passes, which is what CI (no GPU) sees. With a driver the tests run only when
//! `KVFERRY_GPU_TESTS=1` is set, as `scripts/gpu-check` does; then a failure to open device 0
//! is a failure, not a skip.
//!
//! Lines starting `kvferry-gpu:` are read by `scripts/gpu-check` for its summary.
#![cfg(feature = "cuda")]

mod support;

use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvferry_cli::demo::spawn_serve_logged;
use kvferry_transfer::cuda::{self, CudaDevice, CudaError, CudaPool};
use kvferry_ucx::{Context, MemoryType, Request, Worker};
use support::Kvferry;

const OPT_IN: &str = "KVFERRY_GPU_TESTS";

/// Device 0, or `None` after printing why `test` is skipped.
fn gpu(test: &str) -> Option<CudaDevice> {
    if !cuda::driver_present() {
        println!("{test}: skipped: no CUDA driver (libcuda not found)");
        return None;
    }
    if std::env::var_os(OPT_IN).is_none_or(|v| v != "1") {
        println!("{test}: skipped: a CUDA driver is present; set {OPT_IN}=1 to run GPU tests");
        return None;
    }
    let device = CudaDevice::open(0).unwrap_or_else(|e| {
        panic!(
            "{test}: open device 0: {}",
            kvferry_testkit::error_chain(&e)
        )
    });
    Some(device)
}

/// Tag bytes: position-dependent, never zero, different per seed.
fn tags(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (((i as u32).wrapping_mul(2_654_435_761) >> 13) as u8 ^ seed) | 1)
        .collect()
}

#[test]
fn device_opens_and_reports_itself() {
    let Some(device) = gpu("device_opens_and_reports_itself") else {
        return;
    };
    let count = cuda::device_count().unwrap();
    let total = device.total_memory().unwrap();
    println!(
        "kvferry-gpu: device 0 of {count}: {} ({} MiB)",
        device.name(),
        total >> 20
    );
    assert!(count >= 1);
    assert_eq!(device.ordinal(), 0);
    assert!(!device.name().is_empty());
    assert!(total > 0);
    let err = CudaDevice::open(count).unwrap_err();
    assert!(
        matches!(err, CudaError::NoDevice { ordinal, count: c } if ordinal == count && c == count),
        "{err}"
    );
}

#[test]
fn pool_upload_download_roundtrip() {
    let Some(device) = gpu("pool_upload_download_roundtrip") else {
        return;
    };
    const LEN: usize = 8 << 20;
    let pool = CudaPool::new(&device, LEN).unwrap();
    assert_eq!(pool.len(), LEN);
    assert_ne!(pool.device_ptr(), 0);

    let mut got = vec![0xAAu8; LEN];
    pool.download(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0), "a new pool is zero-filled");

    let whole = tags(LEN, 0x3C);
    pool.upload(0, &whole).unwrap();
    pool.download(0, &mut got).unwrap();
    assert!(
        got == whole,
        "downloaded bytes differ from the uploaded tags"
    );

    // An unaligned interior range, and the bytes around it untouched.
    let (offset, patch) = (4093, tags(65_537, 0xC3));
    pool.upload(offset, &patch).unwrap();
    let mut window = vec![0u8; patch.len() + 2];
    pool.download(offset - 1, &mut window).unwrap();
    assert_eq!(window[0], whole[offset - 1]);
    assert!(window[1..=patch.len()] == patch[..]);
    assert_eq!(window[patch.len() + 1], whole[offset + patch.len()]);

    // Bounds are checked before the driver is asked.
    let err = pool.upload(LEN - 3, &[1, 2, 3, 4]).unwrap_err();
    assert!(matches!(err, CudaError::OutOfBounds { .. }), "{err}");
    let err = pool.download(usize::MAX, &mut [0u8; 2]).unwrap_err();
    assert!(matches!(err, CudaError::OutOfBounds { .. }), "{err}");
    pool.upload(LEN, &[]).unwrap();
    assert!(matches!(
        CudaPool::new(&device, 0),
        Err(CudaError::EmptyPool)
    ));
    println!("kvferry-gpu: pool roundtrip verified ({} MiB)", LEN >> 20);
}

/// Waits for `request`, progressing both workers (the target must progress for emulated
/// puts), failing instead of hanging.
fn drive(mut request: Request<'_>, workers: &[&Worker]) -> Result<(), kvferry_ucx::Error> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !request.is_done() {
        assert!(
            Instant::now() < deadline,
            "{:?} did not finish in 20 s",
            request.op()
        );
        for worker in workers {
            worker.progress();
        }
    }
    request.wait()
}

/// Either outcome of registration is a pass, as long as it is clean: with a CUDA-enabled UCX
/// the pool is registered and a put from host memory lands in it; without one (Debian's UCX)
/// the refusal names the UCX version. A panic or any other error fails.
#[test]
fn pool_registers_with_ucx_or_is_refused_cleanly() {
    let Some(device) = gpu("pool_registers_with_ucx_or_is_refused_cleanly") else {
        return;
    };
    const LEN: usize = 4 << 20;
    let pool = CudaPool::new(&device, LEN).unwrap();
    let ctx_b = Context::new().expect("create UCX context");
    let outcome = panic::catch_unwind(AssertUnwindSafe(|| cuda::register_with_ucx(&ctx_b, &pool)));
    let registered = match outcome {
        Err(_) => panic!("register_with_ucx panicked"),
        Ok(Err(err @ CudaError::UcxLacksCuda { .. })) => {
            let message = err.to_string();
            println!("kvferry-gpu: ucx: refused: {message}");
            assert!(message.contains(kvferry_ucx::version()), "{message}");
            assert!(message.contains("--with-cuda"), "{message}");
            return;
        }
        Ok(Err(err)) => panic!("register_with_ucx failed: {err} ({err:?})"),
        Ok(Ok(region)) => region,
    };
    assert_eq!(registered.memory_type(), MemoryType::CUDA);
    assert_eq!(registered.remote_addr(), pool.device_ptr());
    assert_eq!(registered.len(), LEN);
    let host_access = panic::catch_unwind(AssertUnwindSafe(|| {
        registered.read_at(0, &mut [0u8; 1]);
    }));
    assert!(
        host_access.is_err(),
        "host read of a device region must panic"
    );

    // Put host bytes into the device pool through a second worker in this process.
    let b = Worker::new(&ctx_b).unwrap();
    let ctx_a: Arc<Context> = Context::new().unwrap();
    let a = Worker::new(&ctx_a).unwrap();
    let ep = a.connect(&b.address().unwrap()).unwrap();
    let rkey = ep
        .unpack_rkey(registered.pack_rkey().unwrap().as_bytes())
        .unwrap();
    let expected = tags(LEN, 0x99);
    for (i, chunk) in expected.chunks(LEN / 8).enumerate() {
        let remote = pool.device_ptr() + (i * (LEN / 8)) as u64;
        let put = ep
            .put(chunk, remote, &rkey)
            .expect("start put into device pool");
        drive(put, &[&a, &b]).expect("put into device pool");
    }
    drive(ep.flush().unwrap(), &[&a, &b]).expect("flush puts into device pool");
    drop(rkey);
    drop(ep);

    let mut got = vec![0u8; LEN];
    pool.download(0, &mut got).unwrap();
    assert!(got == expected, "device pool differs from what was put");
    // The region keeps the allocation alive on its own.
    drop(pool);
    drop(registered);
    println!(
        "kvferry-gpu: ucx: registered; put host->device verified ({} MiB, UCX {})",
        LEN >> 20,
        kvferry_ucx::version()
    );
}

/// `serve --role generation --memory cuda` of a small instance.
const SERVE_CUDA: [&str; 13] = [
    "serve",
    "--role",
    "generation",
    "--memory",
    "cuda",
    "--model",
    "llama-3-70b",
    "--deployment",
    "tp1",
    "--listen",
    "127.0.0.1:0",
    "--slots",
    "8",
];

/// What `serve --memory cuda` did: listened (and was stopped), or exited before it listened.
enum Served {
    Listened,
    Exited {
        /// Why it did not start, as `kvferry demo` reports it: `generation server: exited
        /// before it listened (exit status: N): ...`.
        error: String,
        /// Its whole standard error.
        stderr: String,
    },
}

/// Runs `serve --memory cuda` until it listens (then stops it) or exits.
fn serve_cuda() -> Served {
    let (tx, rx) = mpsc::channel();
    let spawned = spawn_serve_logged(
        Kvferry::new().quiet().args(SERVE_CUDA).command(),
        "generation",
        move |line| {
            let _ = tx.send(line.to_string());
        },
    );
    match spawned {
        Ok((mut child, addrs)) => {
            println!(
                "kvferry-gpu: serve --memory cuda: control on {}",
                addrs.control
            );
            let _ = child.kill();
            let _ = child.wait();
            Served::Listened
        }
        // Every line of its standard error was handed over before the error returned.
        Err(e) => Served::Exited {
            error: e.to_string(),
            stderr: rx.try_iter().collect::<Vec<_>>().join("\n"),
        },
    }
}

/// The error of a `kvferry serve` child that exited with status 1 before it listened.
const EXITED_1: &str = "exited before it listened (exit status: 1)";

/// `serve --memory cuda` never silently falls back to host memory: without a driver it exits
/// 1 with the no-driver error before listening; with one (and `KVFERRY_GPU_TESTS=1`) it either
/// serves device pools, and then a small `demo --memory cuda` verifies every byte, or refuses a
/// UCX without CUDA support with the library's message.
#[test]
fn serve_memory_cuda_refuses_cleanly_or_serves() {
    const TEST: &str = "serve_memory_cuda_refuses_cleanly_or_serves";
    if !cuda::driver_present() {
        let Served::Exited { error, stderr } = serve_cuda() else {
            panic!("{TEST}: serve --memory cuda listened without a CUDA driver");
        };
        assert!(error.contains(EXITED_1), "{error}\n{stderr}");
        assert!(
            stderr.contains("kvferry: starting generation instance gen-"),
            "{stderr}"
        );
        assert!(
            stderr.contains("no CUDA driver: libcuda not found (searched for "),
            "{stderr}"
        );
        assert!(
            stderr.contains("install the NVIDIA driver or add its directory to LD_LIBRARY_PATH"),
            "{stderr}"
        );
        println!("{TEST}: no CUDA driver: serve refused: {}", stderr.trim());
        // demo and bench report their first child's error as their own.
        for command in ["demo", "bench"] {
            let out = Kvferry::new()
                .quiet()
                .args([command, "--memory", "cuda", "--model", "llama-3-70b"])
                .args(["--ctx", "tp1", "--gen", "tp1", "--prompt-len", "64"])
                .output();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{command}: {stderr}");
            let last = stderr.lines().last().unwrap_or_default();
            assert!(
                last.starts_with(
                    "kvferry: context server: exited before it listened (exit status: 1): \
                     starting context instance ctx-"
                ),
                "{command}: {stderr}"
            );
            assert!(
                last.contains(": no CUDA driver: libcuda not found"),
                "{last}"
            );
            println!("{TEST}: no CUDA driver: {command} refused: {last}");
        }
        return;
    }
    if std::env::var_os(OPT_IN).is_none_or(|v| v != "1") {
        println!("{TEST}: skipped: a CUDA driver is present; set {OPT_IN}=1 to run GPU tests");
        return;
    }
    match serve_cuda() {
        Served::Exited { error, stderr } => {
            assert!(error.contains(EXITED_1), "{error}\n{stderr}");
            assert!(
                stderr.contains(&format!(
                    "UCX {} was built without CUDA support",
                    kvferry_ucx::version()
                )),
                "{stderr}"
            );
            assert!(stderr.contains("--with-cuda"), "{stderr}");
            println!(
                "kvferry-gpu: serve --memory cuda: refused: {}",
                stderr.trim()
            );
        }
        Served::Listened => {
            let report = Kvferry::new()
                .quiet()
                .args(["demo", "--memory", "cuda", "--model", "llama-3-70b"])
                .args(["--ctx", "tp1", "--gen", "tp1", "--requests", "4"])
                .args(["--prompt-len", "96", "--in-flight", "2", "--json"])
                .json();
            assert_eq!(report["memory"], "cuda", "{report}");
            assert_eq!(report["verified"], true, "{report}");
            println!(
                "kvferry-gpu: demo --memory cuda: verified ({} bytes moved, {} checked)",
                report["bytes"], report["verified_bytes"]
            );
        }
    }
}
