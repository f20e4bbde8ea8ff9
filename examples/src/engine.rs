//! What the engine example's programs share (`engine_prefill`, `engine_decode`,
//! `engine_decode_failover`): a small GQA model's KV cache in the engine's own pools, a block
//! allocator, the byte pattern the prefill writes and the decode checks, the request
//! workload both sides derive from one seed, and the agent's setup.
//!
//! # The model and its layout
//!
//! 4 layers, 8 KV heads of 128 BF16 elements, K and V, 16 tokens per block. Every rank of a
//! TP-`N` instance holds `8 / N` heads of every layer (HND, sharded by head). One PAGED
//! layer group, one pool, one view with roles `{key, value}`; a slot (one block) holds, per
//! layer, `[K][V]`, each `[head][token][dim]`. The two sides lay the slot out differently
//! ([`PoolLayout`]): the prefill packs layers `0, 1, 2, 3` back to back; the decode stores them
//! last first, with a gap between layers and padding after every slot, in a pool of its own
//! size. Nothing else is shared but the model: the planner maps one layout onto the other.
//!
//! # The pattern
//!
//! Every 256-byte row (one head of one token of one layer's K or V) is a function of the
//! model coordinates alone: (request, layer, K/V, global head, token), never of the slot or
//! rank that holds it ([`fill_row`]), so the decode checks each received row on its own,
//! whatever TP split and slots the prefill used.

use std::alloc::Layout;
use std::path::Path;
use std::ptr::NonNull;
use std::time::Duration;

use anyhow::{Context as _, Result, anyhow, bail};
use kvferry::abi::ffi::{RString, RVec};
use kvferry::abi::{
    BufferEntry, Deployment, GroupKind, LayerGroup, LayoutKind, LocalLayer, Mapping, MemoryType,
    PageTable, PhysicalPool, PoolView, RankInfo, RoleLayout, SlotTable,
};
use kvferry::agent::{Agent, AgentConfig, CallError, Event, Expect, FailureKind, Secret};
use kvferry::registry::{BoundPlanner, Registry};
use kvferry::{Role, Transport};

/// Model layers.
pub const LAYERS: u32 = 4;
/// KV heads of the model.
pub const KV_HEADS: u32 = 8;
/// Elements per head.
pub const HEAD_DIM: u64 = 128;
/// Bytes per element (BF16).
pub const ELEM_BYTES: u64 = 2;
/// Tokens per block (one slot).
pub const TPB: u64 = 16;
/// Bytes of one row: one head of one token.
pub const ROW: u64 = HEAD_DIM * ELEM_BYTES;
/// The longest prompt the workload draws.
pub const MAX_PROMPT: u64 = 384;
/// Requests a decode rank keeps in flight at once.
pub const DECODE_WINDOW: usize = 6;
/// The planner both sides bind, linked into the binaries.
pub const PLANNER: &str = "kvferry.default";

/// The pattern's salt for rows the prefill computed (and the decode receives).
pub const SALT_PREFILL: u64 = 0x5052_4546_494c_4c00;
/// The pattern's salt for rows the decode already holds (a cached prefix).
pub const SALT_CACHED: u64 = 0x4341_4348_4544_0000;

/// How one side lays out its pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolLayout {
    /// Slots (blocks) in the pool.
    pub slots: u64,
    /// Bytes after every slot's payload (`slot_stride = slot_bytes + slot_padding`).
    pub slot_padding: u64,
    /// Bytes between two layers' regions inside a slot.
    pub layer_gap: u64,
    /// Layers stored last first inside a slot.
    pub reversed: bool,
}

/// The prefill's layout: 256 packed slots, layers in order.
pub const PREFILL_LAYOUT: PoolLayout = PoolLayout {
    slots: 256,
    slot_padding: 0,
    layer_gap: 0,
    reversed: false,
};

/// The decode's layout: 224 slots padded by 4 KiB, layers last first with 512-byte gaps.
pub const DECODE_LAYOUT: PoolLayout = PoolLayout {
    slots: 224,
    slot_padding: 4096,
    layer_gap: 512,
    reversed: true,
};

// ---------------------------------------------------------------------------------------
// Memory.

/// One page-aligned, zeroed host allocation the engine owns (a KV pool).
#[derive(Debug)]
pub struct HostPool {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl HostPool {
    /// `bytes` zeroed bytes, 4 KiB aligned.
    ///
    /// # Errors
    ///
    /// The allocation fails.
    pub fn new(bytes: u64) -> Result<Self> {
        let layout = Layout::from_size_align(bytes.max(1) as usize, 4096)?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| anyhow!("cannot allocate {bytes} bytes"))?;
        Ok(Self { ptr, layout })
    }

    /// The pool's base address, as a page table carries it.
    pub fn base(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }
}

impl Drop for HostPool {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc_zeroed` with this `layout` and is freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// One rank's KV cache: its pool, where every row of a slot lies, and its page table.
#[derive(Debug)]
pub struct RankCache {
    pool: HostPool,
    layout: PoolLayout,
    /// This rank's TP size and rank.
    pub tp: u32,
    /// This rank's TP rank.
    pub tp_rank: u32,
    /// Heads this rank holds (`KV_HEADS / tp`).
    pub heads: u32,
    buffer_bytes: u64,
    slot_bytes: u64,
    stride: u64,
    /// Offset of each (global) layer's region inside a slot.
    layer_offset: Vec<u64>,
}

impl RankCache {
    /// The cache of rank `tp_rank` of a TP-`tp` instance, laid out as `layout`, in a fresh
    /// allocation.
    ///
    /// # Errors
    ///
    /// `tp` does not divide the heads, or the allocation fails.
    pub fn new(tp: u32, tp_rank: u32, layout: PoolLayout) -> Result<Self> {
        if tp == 0 || KV_HEADS % tp != 0 || tp_rank >= tp {
            bail!("rank {tp_rank} of tp{tp}: the {KV_HEADS} KV heads do not split that way");
        }
        let heads = KV_HEADS / tp;
        let buffer_bytes = u64::from(heads) * TPB * ROW;
        let region = 2 * buffer_bytes;
        let layer_offset: Vec<u64> = (0..LAYERS)
            .map(|l| {
                let position = if layout.reversed { LAYERS - 1 - l } else { l };
                u64::from(position) * (region + layout.layer_gap)
            })
            .collect();
        let slot_bytes = u64::from(LAYERS) * region + u64::from(LAYERS - 1) * layout.layer_gap;
        let stride = slot_bytes + layout.slot_padding;
        let footprint = (layout.slots - 1) * stride + slot_bytes;
        Ok(Self {
            pool: HostPool::new(footprint)?,
            layout,
            tp,
            tp_rank,
            heads,
            buffer_bytes,
            slot_bytes,
            stride,
            layer_offset,
        })
    }

    /// Slots in the pool.
    pub fn slots(&self) -> u64 {
        self.layout.slots
    }

    /// The page table the agent registers and peers plan against: one pool, one PAGED group
    /// of the four layers, one HND `{key, value}` view sharded by head over TP.
    pub fn page_table(&self) -> PageTable {
        let mut entries = RVec::new();
        for l in 0..LAYERS {
            for kv in 0..2 {
                entries.push(BufferEntry {
                    local_layer: l,
                    offset: self.layer_offset[l as usize] + kv * self.buffer_bytes,
                    size: self.buffer_bytes,
                });
            }
        }
        let layout = RoleLayout {
            num_shards: self.tp,
            shard_index: self.tp_rank,
            // One head's `[token][dim]` block: the unit HND shards move in.
            shard_unit_bytes: TPB * ROW,
            ..RoleLayout::whole(LayoutKind::HND, "bf16", (ELEM_BYTES * 8) as u32)
        };
        PageTable {
            tokens_per_block: TPB as u32,
            pools: RVec::from(vec![PhysicalPool {
                base: self.pool.base(),
                slot_bytes: self.slot_bytes,
                slot_stride: self.stride,
                num_slots: self.layout.slots,
                memory_type: MemoryType::DRAM,
            }]),
            groups: RVec::from(vec![LayerGroup {
                kind: GroupKind::PAGED,
                window: None.into(),
                layers: (0..LAYERS)
                    .map(|l| LocalLayer {
                        local: l,
                        global: l,
                    })
                    .collect(),
                views: RVec::from(vec![PoolView {
                    pool: 0,
                    entries,
                    roles: RVec::from(vec![RString::from("key"), RString::from("value")]),
                    layout,
                }]),
            }]),
        }
    }

    /// This rank's description: rank `tp_rank` of TP-`tp` instance `instance`, no PP, CP or
    /// attention DP.
    pub fn rank_info(&self, instance: &str) -> RankInfo {
        let mapping = Mapping {
            tp: self.tp,
            moe_tp: self.tp,
            ..Mapping::SINGLE
        };
        RankInfo::new(
            instance,
            &mapping,
            self.tp_rank,
            vec![LAYERS],
            self.page_table(),
        )
        .with_planner(PLANNER)
    }

    /// The byte offset, from the pool's base, of the row of `token` for (`layer`, `kv`,
    /// local head `head`) in `slot`.
    fn row_offset(&self, slot: i64, layer: u32, kv: u64, head: u32, token: u64) -> usize {
        (slot as u64 * self.stride
            + self.layer_offset[layer as usize]
            + kv * self.buffer_bytes
            + u64::from(head) * TPB * ROW
            + (token % TPB) * ROW) as usize
    }

    /// The row at `offset` (from [`row_offset`](Self::row_offset)), to write.
    ///
    /// # Safety
    ///
    /// The row's slot is the engine's now: not lent to the agent (before `send`/`expect`,
    /// or after the request's terminal event).
    unsafe fn row_mut(&mut self, offset: usize) -> &mut [u8] {
        // SAFETY: `offset + ROW` lies inside the allocation (a valid slot's row); the caller
        // guarantees the agent does not touch it meanwhile, and `&mut self` that this engine
        // holds no other reference to it.
        unsafe { std::slice::from_raw_parts_mut(self.pool.ptr.as_ptr().add(offset), ROW as usize) }
    }

    /// The row at `offset`, to read.
    ///
    /// # Safety
    ///
    /// As [`row_mut`](Self::row_mut).
    unsafe fn row(&self, offset: usize) -> &[u8] {
        // SAFETY: as in `row_mut`; nothing writes the row while the reference lives.
        unsafe { std::slice::from_raw_parts(self.pool.ptr.as_ptr().add(offset), ROW as usize) }
    }

    /// Writes the pattern for tokens `tokens` of request `request` into the blocks `slots`
    /// (block `b` of the prompt in `slots[b]`), every layer, K and V, every head this rank
    /// holds.
    ///
    /// # Safety
    ///
    /// The slots the tokens fall in are the engine's now (see [`Agent::start`]).
    pub unsafe fn write_tokens(
        &mut self,
        slots: &[i64],
        request: u64,
        tokens: std::ops::Range<u64>,
        salt: u64,
    ) {
        let first_head = self.tp_rank * self.heads;
        for t in tokens {
            let slot = slots[(t / TPB) as usize];
            for layer in 0..LAYERS {
                for kv in 0..2 {
                    for h in 0..self.heads {
                        let seed = row_seed(salt, request, layer, kv, first_head + h, t);
                        let at = self.row_offset(slot, layer, kv, h, t);
                        // SAFETY: the caller lends us the slot; one row at a time.
                        fill_row(unsafe { self.row_mut(at) }, seed);
                    }
                }
            }
        }
    }

    /// Checks every row of tokens `tokens` of request `request` in `slots` against the
    /// pattern with `salt`; returns the rows checked or the first wrong one.
    ///
    /// # Safety
    ///
    /// As [`write_tokens`](Self::write_tokens): the slots are the engine's now.
    pub unsafe fn check_tokens(
        &self,
        slots: &[i64],
        request: u64,
        tokens: std::ops::Range<u64>,
        salt: u64,
    ) -> Result<u64, String> {
        let first_head = self.tp_rank * self.heads;
        let mut rows = 0;
        for t in tokens {
            let slot = slots[(t / TPB) as usize];
            for layer in 0..LAYERS {
                for kv in 0..2 {
                    for h in 0..self.heads {
                        let head = first_head + h;
                        let seed = row_seed(salt, request, layer, kv, head, t);
                        // SAFETY: the caller lends us the slot; one row at a time.
                        let row = unsafe { self.row(self.row_offset(slot, layer, kv, h, t)) };
                        if let Some(byte) = first_mismatch(row, seed) {
                            return Err(format!(
                                "request {request} token {t} layer {layer} {} head {head} (slot \
                                 {slot}): byte {byte} is {:#04x}",
                                if kv == 0 { "K" } else { "V" },
                                row[byte]
                            ));
                        }
                        rows += 1;
                    }
                }
            }
        }
        Ok(rows)
    }
}

/// The request's slot table (one per layer group; this model has one) over `slots`.
pub fn tables(slots: &[i64]) -> Vec<SlotTable> {
    vec![SlotTable::new(slots.iter().copied())]
}

/// Blocks a prompt of `tokens` tokens occupies.
pub fn blocks(tokens: u64) -> usize {
    tokens.div_ceil(TPB) as usize
}

/// A free list of slots: requests take blocks when they start and give them back only on
/// their terminal event.
#[derive(Debug)]
pub struct BlockAllocator {
    free: Vec<i64>,
}

impl BlockAllocator {
    /// Every slot of a `slots`-slot pool free, in an order shuffled by `seed` (so requests
    /// get scattered slots).
    pub fn new(slots: u64, seed: u64) -> Self {
        let mut free: Vec<i64> = (0..slots as i64).collect();
        let mut rng = SplitMix64(seed);
        for i in (1..free.len()).rev() {
            free.swap(i, rng.below(i as u64 + 1) as usize);
        }
        Self { free }
    }

    /// `n` slots, or `None` (nothing taken) when fewer are free.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<i64>> {
        let at = self.free.len().checked_sub(n)?;
        Some(self.free.split_off(at))
    }

    /// Gives `slots` back.
    pub fn free(&mut self, slots: Vec<i64>) {
        self.free.extend(slots);
    }

    /// Slots free now.
    pub fn available(&self) -> usize {
        self.free.len()
    }
}

// ---------------------------------------------------------------------------------------
// The pattern.

/// SplitMix64's finaliser: a well-mixed 64-bit function of `x`.
pub fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The seed of one row, from model coordinates only.
pub fn row_seed(salt: u64, request: u64, layer: u32, kv: u64, head: u32, token: u64) -> u64 {
    [request, u64::from(layer), kv, u64::from(head), token]
        .iter()
        .fold(mix(salt), |h, &v| mix(h ^ v))
}

/// Fills a row from its seed, 8 bytes per step.
pub fn fill_row(row: &mut [u8], seed: u64) {
    for (w, word) in row.chunks_exact_mut(8).enumerate() {
        word.copy_from_slice(&mix(seed.wrapping_add(w as u64)).to_le_bytes());
    }
}

/// The first byte of `row` that differs from the pattern of `seed`.
pub fn first_mismatch(row: &[u8], seed: u64) -> Option<usize> {
    row.chunks_exact(8).enumerate().find_map(|(w, word)| {
        let want = mix(seed.wrapping_add(w as u64)).to_le_bytes();
        word.iter()
            .zip(want)
            .position(|(a, b)| *a != b)
            .map(|i| w * 8 + i)
    })
}

// ---------------------------------------------------------------------------------------
// The workload.

/// A deterministic generator (SplitMix64).
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// A value in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// A value in `lo..=hi`.
    pub fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// `true` with probability `percent` / 100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// What kind of requests a workload draws.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mix {
    /// Random lengths, some chunked, some with a cached prefix on the decode side, some the
    /// decode cancels mid-flight.
    Mixed,
    /// Every request in two chunks or more, none cancelled (so each is half written while its
    /// last chunk is held back).
    Chunked,
    /// Random lengths and cached prefixes only.
    Plain,
}

/// One request as both engines derive it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestSpec {
    /// The id both engines use.
    pub id: u64,
    /// Prompt tokens.
    pub prompt_len: u64,
    /// Chunked prefill: tokens per chunk (a multiple of 16, smaller than the prompt).
    pub chunk: Option<u64>,
    /// Tokens the decode holds already (block-aligned, short of the prompt).
    pub cached_prefix: Option<u64>,
    /// The decode cancels it mid-flight (the prefill holds its last chunk back, so the
    /// cancel always lands before it can complete).
    pub cancel: bool,
}

impl RequestSpec {
    /// The token ranges the prefill sends, in order.
    pub fn chunks(&self) -> Vec<std::ops::Range<u64>> {
        let step = self.chunk.unwrap_or(self.prompt_len);
        (0..self.prompt_len)
            .step_by(step as usize)
            .map(|s| s..(s + step).min(self.prompt_len))
            .collect()
    }
}

/// `count` requests with ids `id_base..`, drawn from `seed` (the same list on every rank of
/// both engines).
pub fn workload(seed: u64, id_base: u64, count: usize, mix: Mix) -> Vec<RequestSpec> {
    let mut rng = SplitMix64(seed ^ mix_salt(mix) ^ id_base.rotate_left(32));
    (0..count)
        .map(|i| {
            // A cancelled request is never the last one, and at most one in a decode window
            // is, so a later request of the same window completes and triggers the cancel.
            let cancel =
                mix == Mix::Mixed && i % DECODE_WINDOW == 2 && i + 1 < count && rng.chance(60);
            let min = if cancel || mix == Mix::Chunked {
                3 * TPB
            } else {
                1
            };
            let prompt_len = rng.between(min, MAX_PROMPT);
            let n = blocks(prompt_len) as u64;
            let chunked = cancel || mix == Mix::Chunked || (mix == Mix::Mixed && rng.chance(40));
            let chunk = (chunked && n >= 2).then(|| TPB * rng.between(1, n - 1));
            let cached_prefix = (n >= 2 && rng.chance(30)).then(|| TPB * rng.between(1, n - 1));
            RequestSpec {
                id: id_base + i as u64,
                prompt_len,
                chunk,
                cached_prefix,
                cancel,
            }
        })
        .collect()
}

fn mix_salt(mix: Mix) -> u64 {
    match mix {
        Mix::Mixed => 0,
        Mix::Chunked => 0xC0,
        Mix::Plain => 0x9_1A17,
    }
}

/// Where the requests an instance serves after its first ones start (`--fresh`).
pub const FRESH_OFFSET: u64 = 500;

/// The `count` fresh requests of an instance whose ids start at `id_base`: plain, ids from
/// `id_base + FRESH_OFFSET`.
pub fn fresh_workload(seed: u64, id_base: u64, count: usize) -> Vec<RequestSpec> {
    workload(seed, id_base + FRESH_OFFSET, count, Mix::Plain)
}

// ---------------------------------------------------------------------------------------
// The agent.

/// The deployment's secret: the file's bytes (trailing newline dropped), else
/// `KVFERRY_SECRET` ([`kvferry::agent::load_secret`]).
///
/// # Errors
///
/// Neither is given, the file cannot be read, or the secret is too short.
pub fn secret(file: Option<&Path>) -> Result<Secret> {
    Ok(kvferry::agent::load_secret(file)?)
}

/// The default planner, linked into the binary, bound for a llama-shaped TP-`tp` instance.
///
/// # Errors
///
/// The planner refuses the deployment.
pub fn bind_planner(tp: u32) -> Result<BoundPlanner> {
    let registry = Registry::from_modules([(kvferry_planner_default::planner_module(), "linked")]);
    let deployment = Deployment {
        architecture: "llama".into(),
        mapping: format!("tp{tp}").parse::<Mapping>()?,
    };
    Ok(registry.bind(PLANNER, &deployment)?)
}

/// Waits until the agent has events or `limit` passed (an engine adds [`Agent::wake_fd`]
/// to its own epoll set instead).
pub fn wait_for_events(agent: &Agent, limit: Duration) {
    let mut fd = libc::pollfd {
        fd: agent.wake_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the call's duration; the descriptor is the agent's and
    // stays open while `agent` lives.
    unsafe { libc::poll(&mut fd, 1, limit.as_millis() as libc::c_int) };
}

/// Drops `agent` before the engine frees its pools or the process exits: `Agent::drop`
/// ends its connections and waits for its threads, so UCX is torn down when it returns.
pub fn stop_agent(agent: Agent) {
    drop(agent);
}

/// Starts logging to stderr (`KVFERRY_LOG` or `RUST_LOG`, default `warn`).
pub fn init_logging() {
    kvferry::logging::init_stderr("warn");
}

/// Writes `text` to `path` atomically (a temporary file renamed over it), so a reader that
/// waits for the file never sees half of it.
///
/// # Errors
///
/// The file cannot be written.
pub fn write_atomically(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// A decode rank.

/// A decode agent's limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// `AgentConfig::timeout`.
    pub timeout: Duration,
    /// `AgentConfig::peer_timeout`.
    pub peer_timeout: Duration,
}

/// How a request ended on a decode rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Received, and every row checked: `rows` prompt rows after the cached prefix hold the
    /// prefill's pattern, `prefix_rows` rows of the cached prefix still hold the decode's.
    Verified {
        /// Rows received and checked.
        rows: u64,
        /// Rows of the cached prefix checked untouched.
        prefix_rows: u64,
        /// Bytes the agent reports written.
        bytes: u64,
    },
    /// Received, but a row is wrong.
    Corrupt(String),
    /// Cancelled by this engine.
    Cancelled,
    /// Failed.
    Failed {
        /// The peer named.
        peer: Option<String>,
        /// Why, by kind.
        kind: FailureKind,
        /// Why, in words.
        detail: String,
    },
}

/// One terminal event on a decode rank, judged.
#[derive(Clone, Debug)]
pub struct Ending {
    /// The request.
    pub id: u64,
    /// What it was (`None`: no such request was open here — a second terminal event).
    pub spec: Option<RequestSpec>,
    /// How it ended.
    pub outcome: Outcome,
}

#[derive(Debug)]
struct Open {
    spec: RequestSpec,
    slots: Vec<i64>,
}

/// A decode engine's rank: its agent over its own cache, its block allocator and the
/// requests it expects. Slots go back to the allocator only on a request's terminal event.
#[derive(Debug)]
pub struct DecodeRank {
    // Declared first, so it is dropped (and stops writing) before the cache it writes into.
    agent: Agent,
    cache: RankCache,
    blocks: BlockAllocator,
    open: std::collections::HashMap<u64, Open>,
}

impl DecodeRank {
    /// Rank `rank` of TP-`tp` decode instance `instance`, over a fresh cache in
    /// [`DECODE_LAYOUT`].
    ///
    /// # Errors
    ///
    /// The cache cannot be allocated or the agent cannot start.
    pub fn start(
        instance: &str,
        tp: u32,
        rank: u32,
        transport: Transport,
        secret: Secret,
        limits: Limits,
        seed: u64,
    ) -> Result<Self> {
        let cache = RankCache::new(tp, rank, DECODE_LAYOUT)?;
        let blocks = BlockAllocator::new(cache.slots(), mix(seed ^ 0xDEC0DE ^ u64::from(rank)));
        let mut config =
            AgentConfig::new(instance, Role::Decode, cache.rank_info(instance), secret);
        config.label = format!("gqa 4x8x128 tp{tp}");
        config.transport = transport.into();
        config.timeout = limits.timeout;
        config.peer_timeout = limits.peer_timeout;
        // SAFETY: the pool is one live allocation owned by `cache`, which the returned value
        // holds and drops after the agent (field order). This rank touches a slot only while
        // it is not lent: before `expect` (the cached prefix) and after the request's
        // terminal event (the check), never in between.
        let agent = unsafe { Agent::start(config, bind_planner(tp)?) }?;
        Ok(Self {
            agent,
            cache,
            blocks,
            open: std::collections::HashMap::new(),
        })
    }

    /// Stops the agent ([`stop_agent`]), then frees the cache.
    pub fn stop(self) {
        let DecodeRank { agent, cache, .. } = self;
        stop_agent(agent);
        drop(cache);
    }

    /// The agent.
    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// Requests expected and not ended.
    pub fn open(&self) -> usize {
        self.open.len()
    }

    /// Expects `spec` from prefill instance `peer` (its ranks' side channels at
    /// `endpoints`): takes its blocks, writes the cached prefix's rows (this engine's own
    /// pattern: a prefix it already holds), and hands the slots to the agent. `Ok(false)`:
    /// not enough free blocks (nothing taken).
    ///
    /// # Errors
    ///
    /// The agent refuses the request.
    pub fn expect(&mut self, spec: &RequestSpec, peer: &str, endpoints: &[String]) -> Result<bool> {
        let Some(slots) = self.blocks.alloc(blocks(spec.prompt_len)) else {
            return Ok(false);
        };
        let prefix = spec.cached_prefix.unwrap_or(0);
        // SAFETY: the slots were free until now: the agent has not been given them yet.
        unsafe {
            self.cache
                .write_tokens(&slots, spec.id, 0..prefix, SALT_CACHED)
        };
        let expect = Expect {
            request: spec.id,
            peer: peer.to_string(),
            endpoints: endpoints.to_vec(),
            ctx_dp_rank: 0,
            prompt_len: spec.prompt_len,
            cached_prefix: spec.cached_prefix,
            tables: tables(&slots),
            excluded_views: Vec::new(),
        };
        if let Err(e) = self.agent.expect(expect) {
            self.blocks.free(slots);
            bail!("expect {}: {e}", spec.id);
        }
        self.open.insert(
            spec.id,
            Open {
                spec: spec.clone(),
                slots,
            },
        );
        Ok(true)
    }

    /// Cancels request `id`. `Ok(())` also when it ended already (its event is on its way).
    ///
    /// # Errors
    ///
    /// Any other refusal.
    pub fn cancel(&self, id: u64) -> Result<()> {
        match self.agent.cancel(id) {
            Ok(()) | Err(CallError::Unknown { .. }) => Ok(()),
            Err(e) => bail!("cancel {id}: {e}"),
        }
    }

    /// Every terminal event since the last call, judged: a received request's rows are
    /// checked against the pattern (tokens after the cached prefix: the prefill's; the
    /// prefix: this engine's own, untouched). A cancelled or failed request's blocks are not
    /// looked at. Either way its blocks are free again.
    pub fn poll(&mut self) -> Vec<Ending> {
        let mut out = Vec::new();
        for event in self.agent.poll() {
            let id = event.request();
            let Some(open) = self.open.remove(&id) else {
                out.push(Ending {
                    id,
                    spec: None,
                    outcome: Outcome::Corrupt(format!("an event for no open request: {event:?}")),
                });
                continue;
            };
            let outcome = match event {
                Event::Received { stats, .. } => {
                    let prefix = open.spec.cached_prefix.unwrap_or(0);
                    // SAFETY: the request's terminal event is out: its slots are ours again.
                    let checked = unsafe {
                        self.cache
                            .check_tokens(
                                &open.slots,
                                id,
                                prefix..open.spec.prompt_len,
                                SALT_PREFILL,
                            )
                            .and_then(|rows| {
                                self.cache
                                    .check_tokens(&open.slots, id, 0..prefix, SALT_CACHED)
                                    .map(|p| (rows, p))
                            })
                    };
                    match checked {
                        Ok((rows, prefix_rows)) => Outcome::Verified {
                            rows,
                            prefix_rows,
                            bytes: stats.bytes,
                        },
                        Err(wrong) => Outcome::Corrupt(wrong),
                    }
                }
                Event::Cancelled { .. } => Outcome::Cancelled,
                Event::Failed {
                    peer, kind, detail, ..
                } => Outcome::Failed { peer, kind, detail },
                other => Outcome::Corrupt(format!("a prefill-side event: {other:?}")),
            };
            self.blocks.free(open.slots);
            out.push(Ending {
                id,
                spec: Some(open.spec),
                outcome,
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_layouts_validate_and_differ() {
        for (tp, layout) in [(2, PREFILL_LAYOUT), (1, DECODE_LAYOUT), (2, DECODE_LAYOUT)] {
            for r in 0..tp {
                let cache = RankCache::new(tp, r, layout).unwrap();
                cache.page_table().validate().unwrap();
            }
        }
        let p = RankCache::new(2, 0, PREFILL_LAYOUT).unwrap();
        let d = RankCache::new(2, 0, DECODE_LAYOUT).unwrap();
        assert_ne!(p.row_offset(1, 0, 0, 0, 0), d.row_offset(1, 0, 0, 0, 0));
    }

    #[test]
    fn the_pattern_round_trips_and_catches_one_wrong_byte() {
        let mut cache = RankCache::new(2, 1, DECODE_LAYOUT).unwrap();
        let slots = [5i64, 2, 9];
        // SAFETY: no agent runs over this cache.
        unsafe {
            cache.write_tokens(&slots, 7, 0..40, SALT_PREFILL);
            assert_eq!(
                cache.check_tokens(&slots, 7, 0..40, SALT_PREFILL),
                Ok(40 * 2 * 4 * 4)
            );
            assert!(cache.check_tokens(&slots, 8, 0..1, SALT_PREFILL).is_err());
            let at = cache.row_offset(9, 3, 1, 2, 33);
            cache.row_mut(at)[17] ^= 1;
            let err = cache
                .check_tokens(&slots, 7, 0..40, SALT_PREFILL)
                .unwrap_err();
            assert!(err.contains("token 33 layer 3 V head 6"), "{err}");
        }
    }

    #[test]
    fn workloads_are_deterministic_and_well_formed() {
        let a = workload(42, 0, 40, Mix::Mixed);
        assert_eq!(a, workload(42, 0, 40, Mix::Mixed));
        assert!(a.iter().any(|r| r.cancel) && a.iter().any(|r| r.chunk.is_some()));
        assert!(a.iter().any(|r| r.cached_prefix.is_some()));
        for r in a.iter().chain(&workload(7, 1000, 20, Mix::Chunked)) {
            let chunks = r.chunks();
            assert_eq!(chunks.last().unwrap().end, r.prompt_len);
            if let Some(c) = r.chunk {
                assert!(
                    c % TPB == 0 && c < r.prompt_len && chunks.len() >= 2,
                    "{r:?}"
                );
            }
            if let Some(p) = r.cached_prefix {
                assert!(p % TPB == 0 && p < r.prompt_len, "{r:?}");
            }
        }
        assert!(
            workload(7, 1000, 20, Mix::Chunked)
                .iter()
                .all(|r| r.chunks().len() >= 2)
        );
        let mut alloc = BlockAllocator::new(10, 3);
        let got = alloc.alloc(4).unwrap();
        assert!(alloc.alloc(7).is_none());
        alloc.free(got);
        assert_eq!(alloc.available(), 10);
    }
}
