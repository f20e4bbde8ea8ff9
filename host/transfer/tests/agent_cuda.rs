//! The agent over engine-owned **device** memory (cargo feature `cuda`): each "engine"
//! allocates its pools with the CUDA driver and hands the device pointers to the agent in a
//! VRAM page table; a request moves GPU to GPU over shm (`cuda_ipc`/`cuda_copy`) and tcp,
//! fragment by fragment and bounced (staging buffer and arena in device memory), and every
//! destination slot is read back from the device and compared with its source.
//!
//! Without the CUDA driver it prints `skipped: ...`; with one it runs only when
//! `KVFERRY_GPU_TESTS=1` (as `scripts/gpu-check` and its bundle set), and then a missing
//! device or a UCX that cannot move device memory is a failure.
#![cfg(feature = "cuda")]

mod support;

use std::time::Duration;

use kvferry_planner_abi::{Mapping, MemoryType, RankInfo};
use kvferry_testkit::builder::Deploy;
use kvferry_transfer::agent::{BounceConfig, BounceMode, Event};
use kvferry_transfer::harness::cuda::{self, CudaDevice, CudaPool};
use kvferry_transfer::{Role, Transport};

use support::*;

const OPT_IN: &str = "KVFERRY_GPU_TESTS";

fn gpu(test: &str) -> Option<CudaDevice> {
    let opted_in = std::env::var_os(OPT_IN).is_some_and(|v| v == "1");
    if !cuda::driver_present() {
        assert!(!opted_in, "{test}: {OPT_IN}=1 but libcuda cannot be loaded");
        println!("{test}: skipped: no CUDA driver (libcuda not found)");
        return None;
    }
    if !opted_in {
        println!("{test}: skipped: a CUDA driver is present; set {OPT_IN}=1 to run GPU tests");
        return None;
    }
    Some(CudaDevice::open(0).unwrap_or_else(|e| panic!("{test}: open device 0: {e}")))
}

/// A rank whose pools are device allocations the "engine" made.
struct DeviceEngine {
    pools: Vec<CudaPool>,
    info: RankInfo,
}

impl DeviceEngine {
    fn new(device: &CudaDevice, name: &str, fill: impl Fn(usize, usize) -> u8) -> Self {
        let model = model();
        let deploy = Deploy::new(name, 1, "tp1".parse::<Mapping>().unwrap(), &model);
        let mut pools = Vec::new();
        let mut info = deploy.rank_in(&model, 0, &mut |_, _, bytes| {
            let pool = CudaPool::new(device, bytes as usize).expect("cuMemAlloc");
            let base = pool.device_ptr();
            pools.push(pool);
            base
        });
        for p in info.page_table.pools.iter_mut() {
            p.memory_type = MemoryType::VRAM;
        }
        for (i, pool) in pools.iter().enumerate() {
            let bytes: Vec<u8> = (0..pool.len()).map(|b| fill(i, b)).collect();
            pool.upload(0, &bytes).expect("upload");
        }
        Self { pools, info }
    }

    fn bytes(&self, pool: usize) -> Vec<u8> {
        let mut out = vec![0u8; self.pools[pool].len()];
        self.pools[pool].download(0, &mut out).expect("download");
        out
    }

    fn tables(&self, slots: &[i64]) -> Vec<kvferry_planner_abi::SlotTable> {
        let groups = self.info.page_table.groups.len();
        (0..groups)
            .map(|_| kvferry_planner_abi::SlotTable::new(slots.iter().copied()))
            .collect()
    }
}

/// One 48-token request from device pools to device pools over `transport`, bouncing as
/// `bounce` says; every destination slot is compared with its source and every other byte
/// must still be the canary. Returns the receiver's stats.
fn move_one(
    device: &CudaDevice,
    transport: Transport,
    bounce: BounceConfig,
) -> kvferry_transfer::RequestStats {
    let src = DeviceEngine::new(device, "prefill", pattern);
    let dst = DeviceEngine::new(device, "decode", |_, _| CANARY);
    let tweak = |c: &mut kvferry_transfer::agent::AgentConfig| {
        c.transport = transport.into();
        c.cuda_device = Some(0);
        c.bounce = bounce;
    };
    let start_on = |role, info: &RankInfo| {
        let engine = Engine {
            buffers: Vec::new(),
            info: info.clone(),
        };
        start(role, &engine, secret(), bound(), tweak)
    };
    let prefill = start_on(Role::Prefill, &src.info);
    let decode = start_on(Role::Decode, &dst.info);
    let (s, d) = ([2i64, 0, 5], [1i64, 6, 3]);
    prefill.send(whole(1, src.tables(&s), 48)).unwrap();
    decode
        .expect(expecting(
            1,
            prefill.endpoint().unwrap(),
            dst.tables(&d),
            48,
        ))
        .unwrap();
    let got = wait(&decode, 1, Duration::from_secs(30));
    let Event::Received { stats, .. } = got else {
        panic!("{transport} bounce {}: {got:?}", bounce.mode);
    };
    drop(decode);
    drop(prefill);
    for (p, pool) in dst.info.page_table.pools.iter().enumerate() {
        let (sb, db) = (src.bytes(p), dst.bytes(p));
        let (stride, bytes) = (pool.slot_stride as usize, pool.slot_bytes as usize);
        for (&a, &b) in s.iter().zip(&d) {
            let (a, b) = (a as usize * stride, b as usize * stride);
            assert_eq!(&db[b..b + bytes], &sb[a..a + bytes], "{transport} pool {p}");
        }
        let written: Vec<usize> = d.iter().map(|&b| b as usize * stride).collect();
        for (i, &byte) in db.iter().enumerate() {
            let inside = written.iter().any(|&w| i >= w && i < w + bytes);
            assert!(
                inside || byte == CANARY,
                "{transport} pool {p} byte {i} touched"
            );
        }
    }
    stats
}

#[test]
fn a_request_moves_between_engine_owned_device_pools_over_shm_and_tcp() {
    const TEST: &str = "a_request_moves_between_engine_owned_device_pools_over_shm_and_tcp";
    let Some(device) = gpu(TEST) else { return };
    for transport in [Transport::Shm, Transport::Tcp] {
        let stats = move_one(&device, transport, BounceConfig::off());
        assert_eq!(stats.stages.scatter_ns, 0, "{transport}: {stats:?}");
        println!(
            "kvferry-gpu: agent {transport}: {} bytes device to device verified",
            stats.bytes
        );
    }
}

/// Bounced between device pools: the staging buffer and the arena are device memory, the
/// gather and scatter device-to-device copies (small staging halves, so the piece takes
/// several chunks through both halves).
#[test]
fn a_request_bounces_between_engine_owned_device_pools_over_shm_and_tcp() {
    const TEST: &str = "a_request_bounces_between_engine_owned_device_pools_over_shm_and_tcp";
    let Some(device) = gpu(TEST) else { return };
    let on = BounceConfig {
        mode: BounceMode::On,
        staging_bytes: 24 << 10,
        ..BounceConfig::default()
    };
    for transport in [Transport::Shm, Transport::Tcp] {
        let stats = move_one(&device, transport, on);
        assert!(
            stats.stages.scatter_ns > 0,
            "{transport}: not bounced: {stats:?}"
        );
        println!(
            "kvferry-gpu: agent {transport} bounced: {} bytes device to device verified \
             ({} fragments in {} puts)",
            stats.bytes, stats.fragments, stats.puts
        );
    }
}
