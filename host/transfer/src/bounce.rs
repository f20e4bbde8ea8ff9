//! Bounce transfers (`transfer-semantics.md` §9): instead of one put per fragment, a writer
//! gathers a piece's fragments into a registered staging buffer and puts the packed image
//! into a region of the receiver's *bounce arena* in a few large puts; the receiver scatters
//! it into its slots by its own plan of the piece before it reports the request `Received`.
//!
//! Thousands of 8 KiB fragments (Llama-3-70B tp4 → tp8) cost a put each, which over `tcp`
//! is a message each; bounced, they cost one put per MiB. Within a node (shared memory) a
//! put already is a copy, so bouncing only adds two: [`BounceMode::Auto`] bounces only where
//! the transports leave the node.
//!
//! - The **arena** (`Arena`) belongs to a decode rank: registered host memory kvferry
//!   allocates once, advertised with the rank's metadata. Each request that passes the
//!   gates of [`kvferry_plan::bounce::reserve`] and fits gets a region of its own for its
//!   life; a request that does not fit is written fragment by fragment, and the log says
//!   why. A region is released at the request's terminal event, or — when a writer may
//!   still write into it (its link died before its last piece) — kept out of use for the
//!   agent's life (quarantined), so a late put can never land in another request's region.
//! - The **staging** buffer ([`Staging`]) belongs to a prefill rank: two halves, so that
//!   while one half's puts are in flight a gather thread fills the other.
//! - The packed image is defined by destination addresses alone
//!   ([`kvferry_plan::bounce::gather_list`], [`kvferry_plan::bounce::scatter_runs`]): the
//!   receiver never takes a writer's word for where a byte goes.
//!
//! Over **device** pools (cargo feature `cuda`) the arena and the staging buffer are device
//! memory on the pools' device (one `cuMemAlloc` each, registered with UCX as CUDA memory),
//! and the gather and scatter are device-to-device copies through the CUDA driver
//! (`cuda::DeviceCopier`: batched with `cuMemcpyBatchAsync` where the driver has it),
//! so a bounced byte never crosses PCIe more often than a put of it would. A rank whose pools
//! mix host and device memory does not bounce (logged).

use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread;

use kvferry_plan::bounce::{BounceLimits, DEFAULT_MIN_BLOCKS};
use kvferry_protocol::PoolKey;
use kvferry_ucx::{Context, MemRegion};

use crate::sync::lock;

/// Whether an agent bounces.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum BounceMode {
    /// Never: every piece goes fragment by fragment.
    Off,
    /// Whenever the receiver offers a region the piece fits in (and any request with at
    /// least one block gets an offer).
    On,
    /// Where it pays: transports that leave the node, requests of at least
    /// [`BounceConfig::min_blocks`] blocks, pieces whose mean fragment is below
    /// 16 KiB (`AUTO_MAX_MEAN_FRAGMENT`).
    #[default]
    Auto,
}

/// Pieces whose fragments average this many bytes or more are not bounced under
/// [`BounceMode::Auto`]. It was 256 KiB, a guess; measured over tcp on the 2-core machine
/// (`kvferry bench --sweep --transport tcp`, 256 and 1,024 fragments a request, the two
/// thresholds alternating, two passes; docs/BENCHMARKS.md, "Bounce transfers"), bouncing paid
/// at 4 KiB (1.56–1.80 GB/s against 0.94–1.12 for the put loop), broke even at 8 KiB, and lost
/// from 16 KiB up: 16, 32 and 128 KiB fragments ran 1.2–1.8× faster per fragment, 64 KiB
/// (where UCX's tcp puts are slow) 0.8–0.9×.
pub(crate) const AUTO_MAX_MEAN_FRAGMENT: u64 = 16 << 10;

impl std::str::FromStr for BounceMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(Self::Off),
            "on" => Ok(Self::On),
            "auto" => Ok(Self::Auto),
            other => Err(format!("bounce mode {other:?}: expected on, off or auto")),
        }
    }
}

impl std::fmt::Display for BounceMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Off => "off",
            Self::On => "on",
            Self::Auto => "auto",
        })
    }
}

/// How an agent bounces ([`crate::agent::AgentConfig::bounce`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BounceConfig {
    /// Off, on or auto.
    pub mode: BounceMode,
    /// Decode ranks: bytes of the arena regions are reserved from (allocated at start).
    pub arena_bytes: u64,
    /// Prefill ranks: bytes of each of the two halves of the staging buffer (allocated at
    /// start); a piece goes out in puts of at most the executor's largest put (1 MiB), one half
    /// at a time.
    pub staging_bytes: u64,
    /// Requests with fewer paged blocks are not offered a region under
    /// [`BounceMode::Auto`] (requests with recurrent state: fewer bytes than
    /// [`min_bytes`](Self::min_bytes)).
    pub min_blocks: u64,
    /// The byte threshold for requests with recurrent state, under [`BounceMode::Auto`].
    pub min_bytes: u64,
}

impl Default for BounceConfig {
    /// Auto, a 256 MiB arena, 2 × 8 MiB of staging, the reference's 96-block threshold and
    /// 4 MiB for requests with state.
    fn default() -> Self {
        Self {
            mode: BounceMode::Auto,
            arena_bytes: 256 << 20,
            staging_bytes: 8 << 20,
            min_blocks: DEFAULT_MIN_BLOCKS,
            min_bytes: 4 << 20,
        }
    }
}

impl BounceConfig {
    /// Bouncing off.
    pub fn off() -> Self {
        Self {
            mode: BounceMode::Off,
            ..Self::default()
        }
    }

    /// The gates a receiver's reservation must pass, for an arena of `capacity` bytes.
    pub(crate) fn limits(&self, capacity: u64) -> BounceLimits {
        let thresholds = match self.mode {
            BounceMode::On => BounceLimits::without_thresholds(),
            _ => BounceLimits {
                min_blocks: self.min_blocks,
                min_bytes: self.min_bytes,
                ..BounceLimits::default()
            },
        };
        BounceLimits {
            capacity,
            fan_in: false,
            ..thresholds
        }
    }

    /// Whether this mode may bounce at all over `transport`: not when off, and under auto
    /// not over node-local transports, where a put already is a copy.
    pub(crate) fn may_bounce_over(&self, transport: &crate::TransportSpec) -> bool {
        match self.mode {
            BounceMode::Off => false,
            BounceMode::On => true,
            BounceMode::Auto => !transport.is_node_local(),
        }
    }
}

/// How the gather and scatter copy: host memory by the CPU, device memory through the CUDA
/// driver.
#[derive(Clone, Debug)]
pub(crate) enum Copier {
    /// `memcpy`.
    Host,
    /// Device-to-device copies on the pools' device.
    #[cfg(feature = "cuda")]
    Device(Arc<crate::cuda::DeviceCopier>),
}

impl Copier {
    /// Whether it copies host memory (else device memory).
    pub(crate) fn is_host(&self) -> bool {
        matches!(self, Copier::Host)
    }

    /// Copies every run `(destination, source, length)`.
    ///
    /// # Safety
    ///
    /// Every source range is memory of this process of the copier's kind (host, or device
    /// memory the driver knows), readable and not written until this returns; every
    /// destination range is such memory, valid for writes, that nothing else reads or writes
    /// until this returns and that no Rust reference points into; no destination overlaps a
    /// source or another destination.
    pub(crate) unsafe fn copy(&self, runs: &[(u64, u64, u64)]) -> Result<(), String> {
        match self {
            Copier::Host => {
                for &(dst, src, len) in runs {
                    // SAFETY: the caller's contract: both ranges are host memory of this
                    // process, valid for the copy, and they do not overlap.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            src as usize as *const u8,
                            dst as usize as *mut u8,
                            len as usize,
                        );
                    }
                }
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Copier::Device(copier) => {
                // SAFETY: the caller's contract is `DeviceCopier::copy`'s.
                unsafe { copier.copy(runs) }.map_err(|e| kvferry_plan::error_chain(&e))
            }
        }
    }
}

/// Registered bounce memory: host memory UCX allocated, or (cargo feature `cuda`) one device
/// allocation on the pools' device registered as CUDA memory. Zero-filled either way.
fn bounce_region(
    context: &Arc<Context>,
    len: usize,
    copier: &Copier,
    what: &str,
) -> Result<MemRegion, String> {
    match copier {
        Copier::Host => MemRegion::allocate(context, len)
            .map_err(|e| format!("cannot allocate a {len}-byte {what}: {e}")),
        #[cfg(feature = "cuda")]
        Copier::Device(copier) => {
            let device = copier.device();
            let pool = crate::cuda::CudaPool::new(device, len).map_err(|e| {
                format!(
                    "cannot allocate a {len}-byte {what} on cuda device {}: {}",
                    device.ordinal(),
                    kvferry_plan::error_chain(&e)
                )
            })?;
            crate::cuda::register_with_ucx(context, &pool).map_err(|e| {
                format!(
                    "cannot register the {what} with UCX: {}",
                    kvferry_plan::error_chain(&e)
                )
            })
        }
    }
}

/// Bytes regions are aligned to inside the arena.
const REGION_ALIGN: u64 = 64;

/// A region of the arena, reserved for one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Region {
    /// Bytes from the arena's base.
    pub(crate) offset: u64,
    /// Its length.
    pub(crate) len: u64,
}

#[derive(Debug, Default)]
struct Free {
    /// Free ranges `(offset, len)`, ascending, never touching.
    ranges: Vec<(u64, u64)>,
    /// Bytes kept out of use for the agent's life.
    quarantined: u64,
}

/// A decode rank's bounce arena (see the module docs).
#[derive(Debug)]
pub(crate) struct Arena {
    region: MemRegion,
    key: PoolKey,
    free: std::sync::Mutex<Free>,
    copier: Copier,
}

impl Arena {
    /// `bytes` of registered memory of `copier`'s kind on `context`, and its key for peers.
    pub(crate) fn new(context: &Arc<Context>, bytes: u64, copier: Copier) -> Result<Self, String> {
        let len = usize::try_from(bytes).map_err(|_| format!("{bytes} bytes do not fit here"))?;
        let region = bounce_region(context, len, &copier, "bounce arena")?;
        let rkey = region
            .pack_rkey()
            .map_err(|e| format!("cannot pack the bounce arena's key: {e}"))?;
        let key = PoolKey {
            base: region.remote_addr(),
            len: region.len() as u64,
            rkey: rkey.into_bytes(),
        };
        let free = Free {
            ranges: vec![(0, region.len() as u64)],
            quarantined: 0,
        };
        Ok(Self {
            region,
            key,
            free: std::sync::Mutex::new(free),
            copier,
        })
    }

    /// The key peers write the arena with.
    pub(crate) fn key(&self) -> &PoolKey {
        &self.key
    }

    /// Bytes of the arena.
    pub(crate) fn capacity(&self) -> u64 {
        self.key.len
    }

    /// A free region of `len` bytes (first fit), or `None` while the arena has none.
    pub(crate) fn reserve(&self, len: u64) -> Option<Region> {
        let want = len
            .checked_next_multiple_of(REGION_ALIGN)?
            .max(REGION_ALIGN);
        let mut free = lock(&self.free);
        let i = free.ranges.iter().position(|&(_, n)| n >= want)?;
        let (offset, n) = free.ranges[i];
        if n == want {
            free.ranges.remove(i);
        } else {
            free.ranges[i] = (offset + want, n - want);
        }
        Some(Region { offset, len: want })
    }

    /// Gives `region` back: no writer can write into it any more.
    pub(crate) fn release(&self, region: Region) {
        let mut free = lock(&self.free);
        let i = free.ranges.partition_point(|&(o, _)| o < region.offset);
        free.ranges.insert(i, (region.offset, region.len));
        // Merge with the neighbours it touches.
        if i + 1 < free.ranges.len() {
            let (o, n) = free.ranges[i];
            if o + n == free.ranges[i + 1].0 {
                free.ranges[i].1 += free.ranges[i + 1].1;
                free.ranges.remove(i + 1);
            }
        }
        if i > 0 {
            let (o, n) = free.ranges[i - 1];
            if o + n == free.ranges[i].0 {
                free.ranges[i - 1].1 += free.ranges[i].1;
                free.ranges.remove(i);
            }
        }
    }

    /// Keeps `region` out of use for the agent's life: a writer that may still write into
    /// it is not known to have stopped.
    pub(crate) fn quarantine(&self, region: Region) {
        let total = {
            let mut free = lock(&self.free);
            free.quarantined += region.len;
            free.quarantined
        };
        tracing::warn!(
            offset = region.offset,
            bytes = region.len,
            quarantined_total = total,
            "a bounce region whose writer may still write is kept out of use for good"
        );
    }

    /// Copies `runs` (destination address, length; their concatenation is the packed image)
    /// from the arena, starting `offset` bytes in, to the addresses they name; returns once
    /// every byte landed, or why the copy failed (device memory only).
    ///
    /// # Safety
    ///
    /// `[offset, offset + Σ len)` lies inside the arena, and every run's destination is
    /// memory of this process of the arena's kind (host, or device memory on the arena's
    /// device), valid for writes of its length, that nothing else touches until this returns
    /// and no Rust reference points into (the rank's own pools, at addresses its validated
    /// plan names).
    pub(crate) unsafe fn scatter(&self, offset: u64, runs: &[(u64, u64)]) -> Result<(), String> {
        let base = self.region.as_ptr() as u64;
        let mut at = offset;
        let copies: Vec<(u64, u64, u64)> = runs
            .iter()
            .map(|&(dst, len)| {
                let copy = (dst, base + at, len);
                at += len;
                copy
            })
            .collect();
        // SAFETY: the sources lie inside the arena (the caller's range), which this value
        // keeps mapped and which no pool shares, so no destination overlaps one; the
        // destinations are the caller's contract.
        unsafe { self.copier.copy(&copies) }
    }
}

/// A prefill rank's staging buffer: two halves of [`BounceConfig::staging_bytes`].
#[derive(Debug)]
pub struct Staging {
    region: MemRegion,
    half: usize,
    copier: Copier,
}

impl Staging {
    /// Two halves of `half_bytes` of registered memory of `copier`'s kind on `context`.
    pub(crate) fn new(
        context: &Arc<Context>,
        half_bytes: u64,
        copier: Copier,
    ) -> Result<Self, String> {
        let half = usize::try_from(half_bytes)
            .ok()
            .filter(|&h| h > 0)
            .ok_or_else(|| format!("a staging half of {half_bytes} bytes"))?;
        let region = bounce_region(context, half * 2, &copier, "staging buffer")?;
        Ok(Self {
            region,
            half,
            copier,
        })
    }

    /// How its gather copies (and so which pools it gathers from: of the same kind).
    pub(crate) fn copier(&self) -> &Copier {
        &self.copier
    }

    /// The registered memory (puts read from it).
    pub(crate) fn region(&self) -> &MemRegion {
        &self.region
    }

    /// Bytes of one half.
    pub(crate) fn half(&self) -> usize {
        self.half
    }
}

/// One copy job for the gather thread: `(source address, length)` copied one after the
/// other to `dst`.
pub(crate) struct GatherTask {
    pub(crate) parts: Vec<(u64, u64)>,
    pub(crate) dst: u64,
    pub(crate) id: usize,
}

/// A thread that copies gather tasks, in order, and reports each by its id, with why its copy
/// failed if it did (device memory only).
#[derive(Debug)]
pub(crate) struct Gatherer {
    tx: Option<Sender<GatherTask>>,
    pub(crate) done: Receiver<(usize, Result<(), String>)>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Gatherer {
    pub(crate) fn spawn(label: &str, copier: Copier) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<GatherTask>();
        let (done_tx, done) = mpsc::channel();
        let thread = thread::Builder::new()
            .name(format!("gather-{label}"))
            .spawn(move || {
                let mut copies = Vec::new();
                for task in rx {
                    copies.clear();
                    let mut at = task.dst;
                    for (src, len) in task.parts {
                        copies.push((at, src, len));
                        at += len;
                    }
                    // SAFETY: the executor hands over only ranges it checked: sources inside
                    // this rank's pools of the copier's kind (which outlive the executor, and
                    // so this thread's work: the executor waits for every task it submitted
                    // before it returns) and a destination inside one half of the staging
                    // buffer that no put reads until this task is reported.
                    let copied = unsafe { copier.copy(&copies) };
                    if done_tx.send((task.id, copied)).is_err() {
                        return;
                    }
                }
            })?;
        Ok(Self {
            tx: Some(tx),
            done,
            thread: Some(thread),
        })
    }

    /// Queues a task; `false` if the thread is gone.
    pub(crate) fn submit(&self, task: GatherTask) -> bool {
        self.tx.as_ref().is_some_and(|tx| tx.send(task).is_ok())
    }
}

impl Drop for Gatherer {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
