//! CUDA device pools on a real GPU (`--features cuda`).
//!
//! Without the CUDA driver every test prints `skipped: no CUDA driver (libcuda not found)` and
//! passes, which is what CI (no GPU) sees. With a driver the tests run only when
//! `KVFERRY_GPU_TESTS=1` is set, as `scripts/gpu-check` (and its bundle's `run`) does on a
//! machine whose GPUs it has seen. That setting means "this machine must move device memory":
//! then a missing libcuda, a device that does not open, and a UCX that refuses device memory
//! are failures, never skips.
//!
//! Lines starting `kvferry-gpu:` are read by `scripts/gpu-check` for its summary.
#![cfg(feature = "cuda")]

mod support;

use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvferry_harness::demo::spawn_serve_logged;
use kvferry_transfer::harness::cuda::{self, CudaDevice, CudaError, CudaPool};
use kvferry_transfer::{MemoryKind, Transport};
use kvferry_ucx::{MemRegion, MemoryType, Request, Worker};
use support::Kvferry;

const OPT_IN: &str = "KVFERRY_GPU_TESTS";

/// Whether `KVFERRY_GPU_TESTS=1`: GPU tests must run, not skip.
fn opted_in() -> bool {
    std::env::var_os(OPT_IN).is_some_and(|v| v == "1")
}

/// Fails `test` when GPU tests are required but libcuda cannot be loaded.
fn require_driver_if_opted_in(test: &str) {
    if opted_in() && !cuda::driver_present() {
        panic!(
            "{test}: {OPT_IN}=1 but libcuda cannot be loaded: {}",
            CudaDevice::open(0).map_or_else(|e| e.to_string(), |_| "?".into())
        );
    }
}

/// Device 0, or `None` after printing why `test` is skipped.
fn gpu(test: &str) -> Option<CudaDevice> {
    require_driver_if_opted_in(test);
    if !cuda::driver_present() {
        println!("{test}: skipped: no CUDA driver (libcuda not found)");
        return None;
    }
    if !opted_in() {
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

/// Registers `pool` on `ctx`; with GPU tests required, a UCX that refuses device memory fails.
fn register(ctx: &Arc<kvferry_ucx::Context>, pool: &CudaPool, what: &str) -> MemRegion {
    match panic::catch_unwind(AssertUnwindSafe(|| cuda::register_with_ucx(ctx, pool))) {
        Err(_) => panic!("register_with_ucx panicked ({what})"),
        Ok(Err(err)) => panic!(
            "kvferry-gpu: ucx: refused: UCX {} cannot register device memory ({what}): {}",
            kvferry_ucx::version(),
            kvferry_testkit::error_chain(&err)
        ),
        Ok(Ok(region)) => region,
    }
}

/// The pool registers as CUDA memory, its region refuses host access, and a put of host bytes
/// lands in it (through two workers of this process, on the product's shm context).
#[test]
fn pool_registers_with_ucx_and_takes_host_puts() {
    let Some(device) = gpu("pool_registers_with_ucx_and_takes_host_puts") else {
        return;
    };
    const LEN: usize = 4 << 20;
    let pool = CudaPool::new(&device, LEN).unwrap();
    let ctx_b = Transport::Shm.context_for(MemoryKind::Cuda).unwrap();
    let registered = register(&ctx_b, &pool, "shm target");
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

    let b = Worker::new(&ctx_b).unwrap();
    let ctx_a = Transport::Shm.context_for(MemoryKind::Cuda).unwrap();
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

/// What the product does, in one process: UCX contexts made as `serve --memory cuda
/// --transport T` makes them ([`Transport::context_for`]), a device pool registered as the
/// source, and `put_region` (the rank thread's put, with the source's memory handle) in 1 MiB
/// pieces into a device pool and into a host region of the peer; every byte is checked by
/// downloading the device target and reading the host one.
fn puts_from_device_memory(transport: Transport) {
    let test = format!("ucx_puts_from_device_memory_{transport}");
    let Some(device) = gpu(&test) else {
        return;
    };
    const LEN: usize = 16 << 20;
    const PIECE: usize = 1 << 20;
    let ctx_a = transport.context_for(MemoryKind::Cuda).unwrap();
    let ctx_b = transport.context_for(MemoryKind::Cuda).unwrap();
    let source_pool = CudaPool::new(&device, LEN).unwrap();
    let expected = tags(LEN, 0x5E);
    source_pool.upload(0, &expected).unwrap();
    let source = register(&ctx_a, &source_pool, &format!("{transport} source"));
    let target_pool = CudaPool::new(&device, LEN).unwrap();
    let device_target = register(&ctx_b, &target_pool, &format!("{transport} target"));
    let host_target = MemRegion::allocate(&ctx_b, LEN).unwrap();

    let a = Worker::new(&ctx_a).unwrap();
    let b = Worker::new(&ctx_b).unwrap();
    let ep = a.connect(&b.address().unwrap()).unwrap();
    let mut rates = Vec::new();
    for (name, target) in [("device", &device_target), ("host", &host_target)] {
        let rkey = ep
            .unpack_rkey(target.pack_rkey().unwrap().as_bytes())
            .unwrap();
        let started = Instant::now();
        for offset in (0..LEN).step_by(PIECE) {
            let remote = target.remote_addr() + offset as u64;
            let put = ep
                .put_region(&source, offset, PIECE, remote, &rkey)
                .unwrap_or_else(|e| panic!("{test}: start put device->{name}: {e}"));
            drive(put, &[&a, &b]).unwrap_or_else(|e| panic!("{test}: put device->{name}: {e}"));
        }
        drive(ep.flush().unwrap(), &[&a, &b])
            .unwrap_or_else(|e| panic!("{test}: flush puts device->{name}: {e}"));
        let seconds = started.elapsed().as_secs_f64();
        rates.push(format!(
            "device->{name} {:.2} GB/s",
            LEN as f64 / seconds / 1e9
        ));
        let mut got = vec![0u8; LEN];
        if name == "device" {
            target_pool.download(0, &mut got).unwrap();
        } else {
            host_target.read_at(0, &mut got);
        }
        assert!(
            got == expected,
            "{test}: the {name} target differs from the device source"
        );
    }
    drop(ep);
    println!(
        "kvferry-gpu: ucx {transport}: puts from device memory verified ({} MiB each, \
         UCX_TLS={}, UCX {}): {}",
        LEN >> 20,
        transport.tls(MemoryKind::Cuda),
        kvferry_ucx::version(),
        rates.join(", ")
    );
}

#[test]
fn ucx_puts_from_device_memory_shm() {
    puts_from_device_memory(Transport::Shm);
}

#[test]
fn ucx_puts_from_device_memory_tcp() {
    puts_from_device_memory(Transport::Tcp);
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
        /// Why it did not start, as `kvferry demo` reports it: `decode server: exited
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
        Err(e) => {
            let stderr = rx.try_iter().collect::<Vec<_>>().join("\n");
            assert!(
                !stderr.contains("no planner was loaded"),
                "serve found no planner next to {}: build them first (`cargo build --workspace`, \
                 as scripts/test does; scripts/gpu-check builds them itself)\n{stderr}",
                support::kvferry_exe().display()
            );
            Served::Exited {
                error: e.to_string(),
                stderr,
            }
        }
    }
}

/// The error of a `kvferry serve` child that exited with status 1 before it listened.
const EXITED_1: &str = "exited before it listened (exit status: 1)";

/// `serve --memory cuda` never silently falls back to host memory: without a driver it exits
/// 1 with the no-driver error before listening; with one (and `KVFERRY_GPU_TESTS=1`) it serves
/// device pools, and then a small `demo --memory cuda` verifies every byte. A UCX that refuses
/// device memory fails the test then (its refusal message is checked, and shown).
#[test]
fn serve_memory_cuda_refuses_cleanly_or_serves() {
    const TEST: &str = "serve_memory_cuda_refuses_cleanly_or_serves";
    require_driver_if_opted_in(TEST);
    if !cuda::driver_present() {
        let Served::Exited { error, stderr } = serve_cuda() else {
            panic!("{TEST}: serve --memory cuda listened without a CUDA driver");
        };
        // The child's own error line is in the error that it did not start (and only there:
        // it is not passed through as well).
        assert!(error.contains(EXITED_1), "{error}\n{stderr}");
        assert!(error.contains(": starting decode instance gen-"), "{error}");
        assert!(
            error.contains("no CUDA driver: libcuda not found (searched for "),
            "{error}"
        );
        assert!(
            error.contains("install the NVIDIA driver or add its directory to LD_LIBRARY_PATH"),
            "{error}"
        );
        assert!(!stderr.contains("kvferry: starting generation"), "{stderr}");
        println!("{TEST}: no CUDA driver: serve refused: {error}");
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
                    "kvferry: prefill server: exited before it listened (exit status: 1): \
                     starting prefill instance ctx-"
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
    if !opted_in() {
        println!("{TEST}: skipped: a CUDA driver is present; set {OPT_IN}=1 to run GPU tests");
        return;
    }
    match serve_cuda() {
        Served::Exited { error, stderr } => panic!(
            "kvferry-gpu: serve --memory cuda: did not start (UCX {}): {error}\n{stderr}",
            kvferry_ucx::version()
        ),
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
