//! The oracle every planner and transport is tested against: tag, move, check every byte.
//!
//! 1. [`LocalMemory`] hands out pools in a private address space (use it as the `alloc`
//!    callback of [`crate::layout::build_instance`]) and executes [`ValidatedPlan`]s by
//!    copying bytes between them, in safe code.
//! 2. [`Oracle::fill_source`] writes every byte of a sender's pools: the bytes of the slots
//!    the request holds get their **logical tag**, every other byte (other slots, padding) a
//!    "foreign" pattern. [`Oracle::prime_destination`] writes a **canary** pattern over every
//!    byte of a receiver's pools.
//! 3. After the plans ran, [`Oracle::verify`] checks every byte of every receiver pool: the
//!    bytes the request covers must equal their logical tag, all others must still hold their
//!    canary; and the sender pools must be unchanged.
//!
//! # Tags
//!
//! A tag is a function of a byte's *logical* coordinates only, so the same cache byte has the
//! same tag on every rank and under every layout:
//!
//! - PAGED views (HND, NHD, REPLICATED): global layer, role set, buffer index (K = 0, V = 1),
//!   global head (`shard_index × heads_per_rank + local head`), token position
//!   (`global ordinal × tokens_per_block + token in block`) and byte within the head's row of
//!   that token;
//! - STATE HND / REPLICATED views: global layer, role set, buffer, global head, byte within the
//!   head;
//! - STATE SECTIONED views: global layer, role set, section, and the byte's offset in the
//!   whole model's section (`shard_index × local section bytes + offset`).
//!
//! Each run (one head of one token, one state head, one section shard) is keyed by one hash
//! of its coordinates and filled 8 bytes per hash, so fill and check run at memory speed.
//! The geometry comes from the page table alone (layer ranges, `shard_unit_bytes`,
//! `section_bytes`, shard indices, `tokens_per_block`), never from a model preset.
//!
//! # Coverage
//!
//! A receiver byte is covered when it belongs to a (non-excluded) view layer of the receiver
//! whose global layer some context rank holds in a view of the same group kind and role set
//! (non-excluded), and
//! - PAGED: its ordinal lies in a requested piece, the receiver table holds a slot there and
//!   the context side holds the same global ordinal (helix: local ordinal `j` of CP rank `r`
//!   of `C` is global ordinal `j × C + r`);
//! - STATE: both sides hold a slot and the request's last piece was sent.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use kvferry_planner_abi::{
    GroupKind, LayerRange, LayoutKind, PageTable, PairRequest, PhysicalPool, RankInfo, SlotTable,
};

use kvferry_plan::{RequestSide, ValidatedPlan};

/// First address [`LocalMemory`] hands out.
const ADDRESS_BASE: u64 = 0x7100_0000_0000;
/// Pool alignment, and the unmapped gap left after every pool.
const POOL_ALIGN: u64 = 1 << 20;

/// A pool address or range that does not resolve.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MemoryError {
    /// The range starts outside every pool.
    #[error("{address:#x} +{len} lies outside every pool")]
    Unmapped {
        /// Start of the range.
        address: u64,
        /// Length of the range.
        len: u64,
    },
    /// The range starts in a pool and runs past its end.
    #[error("{address:#x} +{len} runs past the end of {pool}")]
    PastEnd {
        /// Start of the range.
        address: u64,
        /// Length of the range.
        len: u64,
        /// The pool's label.
        pool: String,
    },
    /// The pool was reserved for its address but never backed with memory.
    #[error("{pool} is reserved but not backed")]
    NotBacked {
        /// The pool's label.
        pool: String,
    },
    /// No pool starts at the address.
    #[error("no pool starts at {0:#x}")]
    NoPoolAt(u64),
}

struct Region {
    base: u64,
    size: u64,
    label: String,
    data: Option<Vec<u8>>,
}

/// Memory the oracle fills and checks: pools addressed by their page tables' base addresses.
///
/// [`LocalMemory`] implements it for in-process tests; the transfer code implements it over
/// UCX pools. The oracle only copies whole slots in and out through it, so an
/// implementation never hands out references into memory a peer may write.
pub trait PoolMemory {
    /// Copies `out.len()` bytes at `address` into `out`.
    ///
    /// # Errors
    ///
    /// The range does not lie inside one accessible pool.
    fn read(&self, address: u64, out: &mut [u8]) -> Result<(), MemoryError>;

    /// Copies `data` to `address`.
    ///
    /// # Errors
    ///
    /// As [`read`](Self::read).
    fn write(&mut self, address: u64, data: &[u8]) -> Result<(), MemoryError>;

    /// Whether the pool starting at `base` is accessible through this memory.
    fn is_backed(&self, base: u64) -> bool;
}

impl PoolMemory for LocalMemory {
    fn read(&self, address: u64, out: &mut [u8]) -> Result<(), MemoryError> {
        out.copy_from_slice(self.bytes(address, out.len() as u64)?);
        Ok(())
    }

    fn write(&mut self, address: u64, data: &[u8]) -> Result<(), MemoryError> {
        self.bytes_mut(address, data.len() as u64)?
            .copy_from_slice(data);
        Ok(())
    }

    fn is_backed(&self, base: u64) -> bool {
        LocalMemory::is_backed(self, base)
    }
}

/// Which slots of a pool an oracle call touches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Extent {
    /// Every byte of every pool.
    WholePools,
    /// Only the slots the request's slot tables name (the request's own bytes, padding
    /// included), so requests sharing a pool can be filled and checked independently.
    RequestSlots,
}

/// In-process pools in a private address space, and a local plan executor.
///
/// Addresses are synthetic: pools are aligned to 1 MiB and separated by an unmapped gap of
/// at least 1 MiB, so a fragment that leaves its pool is an error rather than a silent write
/// into a neighbour. A pool is first *reserved* (it has an address) and may later be
/// *backed* (it has bytes); only ranks that take part in a request need backing.
#[derive(Default)]
pub struct LocalMemory {
    /// Sorted by base (bases grow monotonically).
    regions: Vec<Region>,
}

impl fmt::Debug for LocalMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalMemory")
            .field("pools", &self.regions.len())
            .field("backed_bytes", &self.backed_bytes())
            .finish()
    }
}

impl LocalMemory {
    /// An empty address space.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reserves `bytes` of address space labelled `label` (e.g. `gen rank 3 pool 1`); returns
    /// the base. Nothing is allocated until [`back`](Self::back).
    pub fn reserve(&mut self, bytes: u64, label: impl Into<String>) -> u64 {
        let base = match self.regions.last() {
            Some(r) => (r.base + r.size).next_multiple_of(POOL_ALIGN) + POOL_ALIGN,
            None => ADDRESS_BASE,
        };
        self.regions.push(Region {
            base,
            size: bytes,
            label: label.into(),
            data: None,
        });
        base
    }

    /// Reserves and backs `bytes` (zeroed); returns the base.
    pub fn allocate(&mut self, bytes: u64, label: impl Into<String>) -> u64 {
        let base = self.reserve(bytes, label);
        if let Some(r) = self.regions.last_mut() {
            r.data = Some(vec![0; r.size as usize]);
        }
        base
    }

    /// Backs the pool reserved at `base` with zeroed bytes; backing twice is a no-op.
    ///
    /// # Errors
    ///
    /// No pool starts at `base`.
    pub fn back(&mut self, base: u64) -> Result<(), MemoryError> {
        let i = self
            .regions
            .binary_search_by_key(&base, |r| r.base)
            .map_err(|_| MemoryError::NoPoolAt(base))?;
        let r = &mut self.regions[i];
        if r.data.is_none() {
            r.data = Some(vec![0; r.size as usize]);
        }
        Ok(())
    }

    /// Whether a pool starts at `base` and is backed.
    pub fn is_backed(&self, base: u64) -> bool {
        self.regions
            .binary_search_by_key(&base, |r| r.base)
            .is_ok_and(|i| self.regions[i].data.is_some())
    }

    /// Bytes backed over all pools.
    pub fn backed_bytes(&self) -> u64 {
        self.regions
            .iter()
            .filter(|r| r.data.is_some())
            .map(|r| r.size)
            .sum()
    }

    /// The bytes `[address, address + len)`.
    ///
    /// # Errors
    ///
    /// The range leaves its pool, lies outside every pool, or its pool is not backed.
    pub fn bytes(&self, address: u64, len: u64) -> Result<&[u8], MemoryError> {
        let (i, off) = self.resolve(address, len)?;
        let data = self.regions[i].data.as_deref().unwrap_or_default();
        Ok(&data[off..off + len as usize])
    }

    /// The bytes `[address, address + len)`, writable.
    ///
    /// # Errors
    ///
    /// As [`bytes`](Self::bytes).
    pub fn bytes_mut(&mut self, address: u64, len: u64) -> Result<&mut [u8], MemoryError> {
        let (i, off) = self.resolve(address, len)?;
        let data = self.regions[i].data.as_deref_mut().unwrap_or_default();
        Ok(&mut data[off..off + len as usize])
    }

    /// Copies every fragment of `plan`, in order; returns the bytes copied.
    ///
    /// # Errors
    ///
    /// The first fragment whose source or destination does not resolve to one backed pool;
    /// the fragments before it have been copied.
    pub fn execute(&mut self, plan: &ValidatedPlan) -> Result<u64, MemoryError> {
        let mut copied = 0;
        for (src, dst, len) in plan.fragments() {
            let (si, so) = self.resolve(src, len)?;
            let (di, dof) = self.resolve(dst, len)?;
            let n = len as usize;
            if si == di {
                if let Some(data) = self.regions[si].data.as_mut() {
                    data.copy_within(so..so + n, dof);
                }
            } else {
                let (lo, hi) = (si.min(di), si.max(di));
                let (left, right) = self.regions.split_at_mut(hi);
                let (a, b) = (&mut left[lo], &mut right[0]);
                let (from, to) = if si < di { (a, b) } else { (b, a) };
                if let (Some(from), Some(to)) = (from.data.as_ref(), to.data.as_mut()) {
                    to[dof..dof + n].copy_from_slice(&from[so..so + n]);
                }
            }
            copied += len;
        }
        Ok(copied)
    }

    /// The backed region holding `[address, address + len)` and the offset in it.
    fn resolve(&self, address: u64, len: u64) -> Result<(usize, usize), MemoryError> {
        let i = self.regions.partition_point(|r| r.base <= address);
        let unmapped = MemoryError::Unmapped { address, len };
        let Some(r) = i.checked_sub(1).map(|i| &self.regions[i]) else {
            return Err(unmapped);
        };
        let off = address - r.base;
        if off >= r.size.max(1) {
            return Err(unmapped);
        }
        if off.checked_add(len).is_none_or(|end| end > r.size) {
            return Err(MemoryError::PastEnd {
                address,
                len,
                pool: r.label.clone(),
            });
        }
        if r.data.is_none() {
            return Err(MemoryError::NotBacked {
                pool: r.label.clone(),
            });
        }
        Ok((i - 1, off as usize))
    }
}

/// Why the oracle could not fill or check.
#[derive(Debug, thiserror::Error)]
pub enum OracleError {
    /// A pool could not be read or written.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// A rank's page table or slot tables cannot be modelled.
    #[error("{instance} rank {rank}: {message}")]
    Input {
        /// The rank's instance.
        instance: String,
        /// The rank.
        rank: u32,
        /// What is wrong.
        message: String,
    },
}

fn input_error(info: &RankInfo, message: impl Into<String>) -> OracleError {
    OracleError::Input {
        instance: info.instance_name.to_string(),
        rank: info.instance_rank,
        message: message.into(),
    }
}

/// Which side of the transfer a checked byte is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// A sender (context) pool.
    Source,
    /// A receiver (generation) pool.
    Destination,
}

/// The logical identity of a byte.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Logical {
    /// A byte of a PAGED view.
    Token {
        /// Global layer.
        layer: u32,
        /// The view's roles, comma-separated.
        roles: String,
        /// Buffer index inside the layer (K = 0, V = 1).
        buffer: u32,
        /// Global head.
        head: u64,
        /// Token position in the prompt.
        token: u64,
        /// Byte within the head's row of that token.
        byte: u64,
    },
    /// A byte of a STATE head (or a replicated state buffer).
    State {
        /// Global layer.
        layer: u32,
        /// The view's roles.
        roles: String,
        /// Buffer index inside the layer.
        buffer: u32,
        /// Global head.
        head: u64,
        /// Byte within the head.
        byte: u64,
    },
    /// A byte of a STATE section.
    Section {
        /// Global layer.
        layer: u32,
        /// The view's roles.
        roles: String,
        /// Section index.
        section: u32,
        /// Offset in the whole model's section.
        byte: u64,
    },
    /// A destination byte the request does not cover (expected: canary).
    Uncovered {
        /// The slot it lies in.
        slot: u64,
        /// Whether it is slot padding.
        padding: bool,
    },
    /// A source byte outside the request (expected: the foreign pattern).
    Foreign {
        /// The slot it lies in.
        slot: u64,
        /// Whether it is slot padding.
        padding: bool,
    },
}

impl fmt::Display for Logical {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Logical::Token {
                layer,
                roles,
                buffer,
                head,
                token,
                byte,
            } => write!(
                f,
                "layer {layer} {{{roles}}} buffer {buffer} head {head} token {token} byte {byte}"
            ),
            Logical::State {
                layer,
                roles,
                buffer,
                head,
                byte,
            } => write!(
                f,
                "state layer {layer} {{{roles}}} buffer {buffer} head {head} byte {byte}"
            ),
            Logical::Section {
                layer,
                roles,
                section,
                byte,
            } => write!(
                f,
                "state layer {layer} {{{roles}}} section {section} byte {byte}"
            ),
            Logical::Uncovered { slot, padding } => {
                let what = if *padding { "padding of" } else { "uncovered" };
                write!(f, "{what} slot {slot} (canary)")
            }
            Logical::Foreign { slot, padding } => {
                let what = if *padding {
                    "padding of"
                } else {
                    "unrequested"
                };
                write!(f, "{what} slot {slot} (foreign)")
            }
        }
    }
}

/// One byte that differs from what the oracle expected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// Sender or receiver pool.
    pub side: Side,
    /// Instance of the rank.
    pub instance: String,
    /// The rank.
    pub rank: u32,
    /// Pool index in the rank's page table.
    pub pool: u32,
    /// Offset from the pool's base.
    pub offset: u64,
    /// What the byte stands for.
    pub logical: Logical,
    /// The expected value.
    pub expected: u8,
    /// The value found.
    pub found: u8,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let side = match self.side {
            Side::Source => "source",
            Side::Destination => "destination",
        };
        write!(
            f,
            "{side} {} rank {} pool {} offset {:#x} ({}): expected {:#04x}, found {:#04x}",
            self.instance,
            self.rank,
            self.pool,
            self.offset,
            self.logical,
            self.expected,
            self.found
        )
    }
}

/// What [`Oracle::verify`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VerifyReport {
    /// Receiver pool bytes checked (every byte of every receiver pool).
    pub bytes_checked: u64,
    /// Of those, bytes the request covers.
    pub bytes_covered: u64,
    /// Sender pool bytes checked.
    pub source_bytes_checked: u64,
    /// Bytes that differ, on both sides.
    pub mismatched_bytes: u64,
    /// The first mismatches, in check order (receivers first).
    pub mismatches: Vec<Mismatch>,
}

impl VerifyReport {
    /// Whether every byte matched.
    pub fn is_clean(&self) -> bool {
        self.mismatched_bytes == 0
    }
}

impl fmt::Display for VerifyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} destination bytes checked ({} covered), {} source bytes checked: ",
            self.bytes_checked, self.bytes_covered, self.source_bytes_checked
        )?;
        if self.is_clean() {
            return f.write_str("all match");
        }
        write!(f, "{} bytes differ", self.mismatched_bytes)?;
        for m in &self.mismatches {
            write!(f, "\n  {m}")?;
        }
        if (self.mismatches.len() as u64) < self.mismatched_bytes {
            write!(
                f,
                "\n  ... and {} more",
                self.mismatched_bytes - self.mismatches.len() as u64
            )?;
        }
        Ok(())
    }
}

/// What a request was meant to deliver, for [`Oracle::verify`].
#[derive(Clone, Copy, Debug)]
pub struct Delivery<'a> {
    /// Every rank of the context DP group that served the request, with its slot tables. Their
    /// page tables decide coverage; the backed pools among them are checked to be unchanged.
    pub context: &'a [RequestSide<'a>],
    /// Every receiver rank of the generation DP group, with its slot tables.
    pub receivers: &'a [RequestSide<'a>],
    /// Every piece the senders planned (chunks; the last one has `is_last`).
    pub pieces: &'a [PairRequest],
}

/// Fills and checks pools with logical tags (see the module docs).
#[derive(Clone, Copy, Debug)]
pub struct Oracle {
    salt: u64,
    max_mismatches: usize,
}

impl Default for Oracle {
    fn default() -> Self {
        Self::new(0)
    }
}

impl Oracle {
    /// An oracle whose tags and canaries are keyed by `salt` (e.g. a scenario's seed); it
    /// keeps the first 16 mismatches.
    pub fn new(salt: u64) -> Self {
        Self {
            salt,
            max_mismatches: 16,
        }
    }

    /// The same oracle keeping the first `n` mismatches.
    pub fn with_max_mismatches(mut self, n: usize) -> Self {
        self.max_mismatches = n;
        self
    }

    /// Writes every byte of the sender's pools: logical tags in the slots its tables hold (all
    /// views, all layers), the foreign pattern elsewhere. Returns the bytes written.
    ///
    /// # Errors
    ///
    /// A geometry the oracle cannot model, bad slot tables, or an unbacked pool.
    pub fn fill_source(
        &self,
        memory: &mut dyn PoolMemory,
        side: RequestSide<'_>,
    ) -> Result<u64, OracleError> {
        self.fill_source_in(memory, side, Extent::WholePools)
    }

    /// [`fill_source`](Self::fill_source) over `extent`.
    ///
    /// # Errors
    ///
    /// As [`fill_source`](Self::fill_source).
    pub fn fill_source_in(
        &self,
        memory: &mut dyn PoolMemory,
        side: RequestSide<'_>,
        extent: Extent,
    ) -> Result<u64, OracleError> {
        let model = RankModel::new(self.salt, side.info)?;
        let images = model.source_images(self, side)?;
        let scope = model.scope(extent, side.slot_tables);
        let mut written = 0;
        for image in &images {
            written += model.fill(memory, image, scope.as_deref())?;
        }
        Ok(written)
    }

    /// Writes the canary over every byte of the receiver's pools. Returns the bytes written.
    ///
    /// # Errors
    ///
    /// A geometry the oracle cannot model, or an unbacked pool.
    pub fn prime_destination(
        &self,
        memory: &mut dyn PoolMemory,
        info: &RankInfo,
    ) -> Result<u64, OracleError> {
        self.prime_destination_in(memory, RequestSide::new(info, &[]), Extent::WholePools)
    }

    /// Writes the canary over the receiver's pools within `extent` (for
    /// [`Extent::RequestSlots`], the slots `side`'s tables hold).
    ///
    /// # Errors
    ///
    /// As [`prime_destination`](Self::prime_destination), or bad slot tables.
    pub fn prime_destination_in(
        &self,
        memory: &mut dyn PoolMemory,
        side: RequestSide<'_>,
        extent: Extent,
    ) -> Result<u64, OracleError> {
        let model = RankModel::new(self.salt, side.info)?;
        if extent == Extent::RequestSlots {
            model.check_tables(side.slot_tables)?;
        }
        let scope = model.scope(extent, side.slot_tables);
        let mut written = 0;
        for (p, pool) in side.info.page_table.pools.iter().enumerate() {
            let image =
                PoolImage::blank(self.background(Background::Canary, side.info, p), pool, p);
            written += model.fill(memory, &image, scope.as_deref())?;
        }
        Ok(written)
    }

    /// Checks every byte of every receiver pool and every backed context pool (see the module
    /// docs for coverage).
    ///
    /// # Errors
    ///
    /// A geometry the oracle cannot model, bad slot tables, differing block sizes, or an
    /// unbacked receiver pool. Mismatches are not errors: they are in the report.
    pub fn verify(
        &self,
        memory: &dyn PoolMemory,
        delivery: &Delivery<'_>,
    ) -> Result<VerifyReport, OracleError> {
        self.verify_in(memory, delivery, Extent::WholePools)
    }

    /// [`verify`](Self::verify) over `extent`: with [`Extent::RequestSlots`], only the
    /// slots the receivers' tables hold are checked (covered bytes against their tags, the
    /// rest of those slots against the canary), and likewise the backed senders' slots.
    ///
    /// # Errors
    ///
    /// As [`verify`](Self::verify).
    pub fn verify_in(
        &self,
        memory: &dyn PoolMemory,
        delivery: &Delivery<'_>,
        extent: Extent,
    ) -> Result<VerifyReport, OracleError> {
        let mut report = VerifyReport::default();
        let held = ContextHoldings::new(self.salt, delivery.context)?;
        for receiver in delivery.receivers {
            let model = RankModel::new(self.salt, receiver.info)?;
            let images = model.receiver_images(self, *receiver, &held, delivery.pieces)?;
            let scope = model.scope(extent, receiver.slot_tables);
            for image in &images {
                report.bytes_covered += image.covered_bytes();
                report.bytes_checked += model.check(
                    memory,
                    image,
                    Side::Destination,
                    self,
                    &mut report,
                    scope.as_deref(),
                )?;
            }
        }
        for sender in delivery.context {
            let pools = &sender.info.page_table.pools;
            if !pools.iter().any(|p| memory.is_backed(p.base)) {
                continue;
            }
            let model = RankModel::new(self.salt, sender.info)?;
            let scope = model.scope(extent, sender.slot_tables);
            for image in model.source_images(self, *sender)? {
                if memory.is_backed(image.pool.base) {
                    report.source_bytes_checked += model.check(
                        memory,
                        &image,
                        Side::Source,
                        self,
                        &mut report,
                        scope.as_deref(),
                    )?;
                }
            }
        }
        Ok(report)
    }

    fn background(&self, kind: Background, info: &RankInfo, pool: usize) -> BackgroundSeed {
        let mut h = combine(self.salt, kind as u64);
        h = combine(h, fnv1a(info.instance_name.as_bytes()));
        h = combine(h, u64::from(info.instance_rank));
        BackgroundSeed {
            kind,
            seed: combine(h, pool as u64),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tag streams.

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
/// Stands for "no token" in the seed of a STATE run.
const NO_TOKEN: u64 = u64::MAX;

/// MurmurHash3's 64-bit finalizer: a bijection that mixes every input bit into every output bit.
fn fmix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

fn combine(h: u64, v: u64) -> u64 {
    fmix(h.wrapping_mul(GOLDEN).rotate_left(29) ^ v)
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Word `w` of the stream keyed by `seed`.
#[inline]
fn word(seed: u64, w: u64) -> u64 {
    fmix(seed ^ w.wrapping_mul(GOLDEN))
}

/// Bytes `start .. start + out.len()` of the stream keyed by `seed`.
fn stream(seed: u64, start: u64, out: &mut [u8]) {
    let mut out = out;
    let mut i = start;
    let lead = (i % 8) as usize;
    if lead != 0 {
        let bytes = word(seed, i / 8).to_le_bytes();
        let n = (8 - lead).min(out.len());
        out[..n].copy_from_slice(&bytes[lead..lead + n]);
        out = &mut out[n..];
        i += n as u64;
    }
    let mut w = i / 8;
    let mut words = out.chunks_exact_mut(8);
    for chunk in &mut words {
        chunk.copy_from_slice(&word(seed, w).to_le_bytes());
        w += 1;
    }
    let tail = words.into_remainder();
    if !tail.is_empty() {
        let n = tail.len();
        tail.copy_from_slice(&word(seed, w).to_le_bytes()[..n]);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Background {
    Canary = 1,
    Foreign = 2,
}

#[derive(Clone, Copy, Debug)]
struct BackgroundSeed {
    kind: Background,
    seed: u64,
}

// ---------------------------------------------------------------------------------------------
// Geometry of a rank's views.

/// How a view's layer region splits into runs.
#[derive(Clone, Debug)]
enum Shape {
    /// `buffers × [heads][tokens][row]` (HND, REPLICATED) or `buffers × [tokens][heads][row]`
    /// (NHD); STATE views have one "token".
    Heads {
        heads: u64,
        /// Bytes of one head of one token (PAGED) or of one head (STATE).
        row: u64,
        /// Global index of the rank's first head.
        head_base: u64,
        token_major: bool,
    },
    /// STATE sections, each the rank's shard of the model's section.
    Sections { bytes: Vec<u64>, shard: u64 },
}

#[derive(Clone, Debug)]
struct ViewGeom {
    group: usize,
    view: usize,
    kind: GroupKind,
    pool: usize,
    roles: String,
    roles_hash: u64,
    /// Hash of (salt, kind, roles).
    seed: u64,
    tpb: u64,
    buffers: u64,
    buffer_bytes: u64,
    shape: Shape,
    layers: Vec<LayerRange>,
}

impl ViewGeom {
    fn tokens(&self) -> u64 {
        if self.kind == GroupKind::PAGED {
            self.tpb
        } else {
            1
        }
    }

    /// Calls `run(offset, len, seed, start)` for every run of the region of `layer` whose
    /// first token is `token0`: bytes `offset .. offset + len` of the region are bytes
    /// `start ..` of the stream keyed by `seed`.
    fn for_each_run(&self, layer: u32, token0: u64, mut run: impl FnMut(usize, usize, u64, u64)) {
        let layer_seed = combine(self.seed, u64::from(layer));
        match &self.shape {
            Shape::Heads {
                heads,
                row,
                head_base,
                token_major,
            } => {
                let tokens = self.tokens();
                let paged = self.kind == GroupKind::PAGED;
                for b in 0..self.buffers {
                    let buffer_seed = combine(layer_seed, b);
                    let buffer_off = b * self.buffer_bytes;
                    for h in 0..*heads {
                        let head_seed = combine(buffer_seed, head_base + h);
                        for t in 0..tokens {
                            let token = if paged { token0 + t } else { NO_TOKEN };
                            let off = if *token_major {
                                buffer_off + (t * heads + h) * row
                            } else {
                                buffer_off + (h * tokens + t) * row
                            };
                            run(off as usize, *row as usize, combine(head_seed, token), 0);
                        }
                    }
                }
            }
            Shape::Sections { bytes, shard } => {
                let mut off = 0;
                for (k, &len) in bytes.iter().enumerate() {
                    let seed = combine(combine(layer_seed, k as u64), u64::MAX - 1);
                    run(off as usize, len as usize, seed, shard * len);
                    off += len;
                }
            }
        }
    }

    fn render(&self, layer: u32, token0: u64, out: &mut [u8]) {
        self.for_each_run(layer, token0, |off, len, seed, start| {
            stream(seed, start, &mut out[off..off + len]);
        });
    }

    /// The logical identity of byte `off` of the region of `layer` starting at `token0`.
    fn describe(&self, layer: u32, token0: u64, off: u64) -> Logical {
        let roles = self.roles.clone();
        match &self.shape {
            Shape::Heads {
                heads,
                row,
                head_base,
                token_major,
            } => {
                let tokens = self.tokens();
                let buffer = off / self.buffer_bytes;
                let r = off % self.buffer_bytes;
                let (h, t) = if *token_major {
                    (r / row % heads, r / row / heads)
                } else {
                    (r / row / tokens, r / row % tokens)
                };
                let byte = r % row;
                if self.kind == GroupKind::PAGED {
                    Logical::Token {
                        layer,
                        roles,
                        buffer: buffer as u32,
                        head: head_base + h,
                        token: token0 + t,
                        byte,
                    }
                } else {
                    Logical::State {
                        layer,
                        roles,
                        buffer: buffer as u32,
                        head: head_base + h,
                        byte,
                    }
                }
            }
            Shape::Sections { bytes, shard } => {
                let mut start = 0;
                for (k, &len) in bytes.iter().enumerate() {
                    if off < start + len {
                        return Logical::Section {
                            layer,
                            roles,
                            section: k as u32,
                            byte: shard * len + off - start,
                        };
                    }
                    start += len;
                }
                Logical::Section {
                    layer,
                    roles,
                    section: bytes.len() as u32,
                    byte: off - start,
                }
            }
        }
    }
}

/// One covered view-layer region inside a slot.
#[derive(Clone, Copy, Debug)]
struct Segment {
    offset: u64,
    len: u64,
    geom: usize,
    layer: u32,
    token0: u64,
}

/// The expected content of one pool.
struct PoolImage {
    index: usize,
    pool: PhysicalPool,
    background: BackgroundSeed,
    /// Segments by slot, sorted by offset, non-overlapping.
    slots: BTreeMap<u64, Vec<Segment>>,
}

impl PoolImage {
    fn blank(background: BackgroundSeed, pool: &PhysicalPool, index: usize) -> Self {
        Self {
            index,
            pool: pool.clone(),
            background,
            slots: BTreeMap::new(),
        }
    }

    fn covered_bytes(&self) -> u64 {
        self.slots.values().flatten().map(|s| s.len).sum()
    }

    /// Offset and length of slot `s`'s span in the pool's footprint.
    fn span(&self, s: u64) -> (u64, u64) {
        let start = s * self.pool.slot_stride;
        let len = if s + 1 == self.pool.num_slots {
            self.pool.slot_bytes
        } else {
            self.pool.slot_stride
        };
        (start, len)
    }
}

/// A rank's views, modelled.
struct RankModel<'a> {
    info: &'a RankInfo,
    geoms: Vec<ViewGeom>,
}

impl<'a> RankModel<'a> {
    fn new(salt: u64, info: &'a RankInfo) -> Result<Self, OracleError> {
        Ok(Self {
            info,
            geoms: model_views(salt, info)?,
        })
    }

    fn page_table(&self) -> &PageTable {
        &self.info.page_table
    }

    /// Global ordinal of local ordinal `j` (helix: `j × C + r`).
    fn global_ordinal(&self, j: u64) -> u64 {
        let cp = u64::from(self.info.cp_size);
        if cp > 1 {
            j * cp + u64::from(self.info.cp_rank)
        } else {
            j
        }
    }

    fn check_tables(&self, tables: &[SlotTable]) -> Result<(), OracleError> {
        let pt = self.page_table();
        if tables.len() != pt.groups.len() {
            return Err(input_error(
                self.info,
                format!(
                    "{} slot tables for {} layer groups",
                    tables.len(),
                    pt.groups.len()
                ),
            ));
        }
        for (g, (group, table)) in pt.groups.iter().zip(tables).enumerate() {
            if group.kind == GroupKind::STATE && table.slots.len() > 1 {
                return Err(input_error(
                    self.info,
                    format!(
                        "STATE group {g} has {} slots (at most 1)",
                        table.slots.len()
                    ),
                ));
            }
            for view in group.views.iter() {
                let pool = &pt.pools[view.pool as usize];
                if let Some(&bad) = table
                    .slots
                    .iter()
                    .find(|&&s| s != SlotTable::HOLE && (s < 0 || s as u64 >= pool.num_slots))
                {
                    return Err(input_error(
                        self.info,
                        format!(
                            "group {g} names slot {bad}, outside pool {} of {} slots",
                            view.pool, pool.num_slots
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Images of every pool of a sender: tags in every held slot of every view.
    fn source_images(
        &self,
        oracle: &Oracle,
        side: RequestSide<'_>,
    ) -> Result<Vec<PoolImage>, OracleError> {
        self.check_tables(side.slot_tables)?;
        let mut images = self.blank_images(oracle, Background::Foreign);
        for (gi, geom) in self.geoms.iter().enumerate() {
            let table = &side.slot_tables[geom.group];
            for (j, &slot) in table.slots.iter().enumerate() {
                if slot == SlotTable::HOLE {
                    continue;
                }
                let token0 = self.global_ordinal(j as u64) * geom.tpb;
                for layer in &geom.layers {
                    add_segment(&mut images[geom.pool], slot as u64, gi, layer, token0);
                }
            }
        }
        self.finish(images)
    }

    /// Images of every pool of a receiver: tags where the delivery covers, canary elsewhere.
    fn receiver_images(
        &self,
        oracle: &Oracle,
        side: RequestSide<'_>,
        held: &ContextHoldings,
        pieces: &[PairRequest],
    ) -> Result<Vec<PoolImage>, OracleError> {
        self.check_tables(side.slot_tables)?;
        let tpb = u64::from(self.page_table().tokens_per_block);
        if let Some(ctx_tpb) = held.tokens_per_block {
            if ctx_tpb != tpb {
                return Err(input_error(
                    self.info,
                    format!("tokens_per_block {tpb} differs from the context side's {ctx_tpb}"),
                ));
            }
        }
        let requested: Vec<(u64, u64)> = pieces
            .iter()
            .map(|p| {
                let mut lo = p.token_range.start / tpb;
                if let Some(t) = p.dst_start_token.into_option() {
                    lo = lo.max(t / tpb);
                }
                (lo, p.token_range.end.div_ceil(tpb))
            })
            .collect();
        let last_sent = pieces.iter().any(|p| p.is_last);
        let mut images = self.blank_images(oracle, Background::Canary);
        for (gi, geom) in self.geoms.iter().enumerate() {
            let id = (geom.group as u32, geom.view as u32);
            if side.excluded.iter().any(|e| (e.group, e.view) == id) {
                continue;
            }
            let table = &side.slot_tables[geom.group];
            for layer in &geom.layers {
                let Some(holding) = held.get(geom.kind, geom.roles_hash, layer.global) else {
                    continue;
                };
                if geom.kind == GroupKind::STATE {
                    if let (Some(&slot), true, true) =
                        (table.slots.first(), holding.state, last_sent)
                    {
                        if slot != SlotTable::HOLE {
                            add_segment(&mut images[geom.pool], slot as u64, gi, layer, 0);
                        }
                    }
                    continue;
                }
                for (j, &slot) in table.slots.iter().enumerate() {
                    let g = self.global_ordinal(j as u64);
                    let wanted = requested.iter().any(|&(lo, hi)| (lo..hi).contains(&g));
                    let has = holding.ordinals.get(g as usize).copied().unwrap_or(false);
                    if slot != SlotTable::HOLE && wanted && has {
                        add_segment(&mut images[geom.pool], slot as u64, gi, layer, g * tpb);
                    }
                }
            }
        }
        self.finish(images)
    }

    fn blank_images(&self, oracle: &Oracle, kind: Background) -> Vec<PoolImage> {
        self.page_table()
            .pools
            .iter()
            .enumerate()
            .map(|(p, pool)| PoolImage::blank(oracle.background(kind, self.info, p), pool, p))
            .collect()
    }

    /// Sorts every slot's segments and refuses overlaps (two ordinals in one slot, or views
    /// sharing bytes).
    fn finish(&self, mut images: Vec<PoolImage>) -> Result<Vec<PoolImage>, OracleError> {
        for image in &mut images {
            for (slot, segments) in image.slots.iter_mut() {
                segments.sort_unstable_by_key(|s| s.offset);
                for w in segments.windows(2) {
                    if w[0].offset + w[0].len > w[1].offset {
                        return Err(input_error(
                            self.info,
                            format!(
                                "pool {} slot {slot} is claimed twice (two ordinals in one slot, \
                                 or overlapping views)",
                                image.index
                            ),
                        ));
                    }
                }
            }
        }
        Ok(images)
    }

    /// Renders bytes of slot `s` (its span) into `out`.
    fn render_slot(&self, image: &PoolImage, s: u64, out: &mut [u8]) {
        let (start, _) = image.span(s);
        let bg = image.background.seed;
        let mut cursor = 0usize;
        if let Some(segments) = image.slots.get(&s) {
            for seg in segments {
                let (a, b) = (seg.offset as usize, (seg.offset + seg.len) as usize);
                stream(bg, start + cursor as u64, &mut out[cursor..a]);
                self.geoms[seg.geom].render(seg.layer, seg.token0, &mut out[a..b]);
                cursor = b;
            }
        }
        stream(bg, start + cursor as u64, &mut out[cursor..]);
    }

    /// The slots of each pool an oracle call over `extent` touches: `None` for every slot,
    /// else per pool the slots `tables` hold.
    fn scope(&self, extent: Extent, tables: &[SlotTable]) -> Option<Vec<Vec<u64>>> {
        if extent == Extent::WholePools {
            return None;
        }
        let pt = self.page_table();
        let mut held = vec![Vec::new(); pt.pools.len()];
        for (group, table) in pt.groups.iter().zip(tables) {
            for view in group.views.iter() {
                let Some(slots) = held.get_mut(view.pool as usize) else {
                    continue;
                };
                slots.extend(table.slots.iter().filter(|&&s| s >= 0).map(|&s| s as u64));
            }
        }
        for slots in &mut held {
            slots.sort_unstable();
            slots.dedup();
        }
        Some(held)
    }

    /// The slots of `image`'s pool within `scope`.
    fn slots_in<'s>(
        image: &PoolImage,
        scope: Option<&'s [Vec<u64>]>,
    ) -> Box<dyn Iterator<Item = u64> + 's> {
        match scope {
            None => Box::new(0..image.pool.num_slots),
            Some(scope) => Box::new(
                scope
                    .get(image.index)
                    .map_or(&[][..], Vec::as_slice)
                    .iter()
                    .copied(),
            ),
        }
    }

    fn fill(
        &self,
        memory: &mut dyn PoolMemory,
        image: &PoolImage,
        scope: Option<&[Vec<u64>]>,
    ) -> Result<u64, OracleError> {
        if image.pool.footprint() == 0 {
            return Ok(0);
        }
        let mut scratch = vec![0u8; image.pool.slot_stride as usize];
        let mut written = 0;
        for s in Self::slots_in(image, scope) {
            let (start, len) = image.span(s);
            let out = &mut scratch[..len as usize];
            self.render_slot(image, s, out);
            memory.write(image.pool.base + start, out)?;
            written += len;
        }
        Ok(written)
    }

    fn check(
        &self,
        memory: &dyn PoolMemory,
        image: &PoolImage,
        side: Side,
        oracle: &Oracle,
        report: &mut VerifyReport,
        scope: Option<&[Vec<u64>]>,
    ) -> Result<u64, OracleError> {
        if image.pool.footprint() == 0 {
            return Ok(0);
        }
        let stride = image.pool.slot_stride as usize;
        let mut scratch = vec![0u8; 2 * stride];
        let (expected_buf, found_buf) = scratch.split_at_mut(stride);
        let mut checked = 0;
        for s in Self::slots_in(image, scope) {
            let (start, len) = image.span(s);
            let expected = &mut expected_buf[..len as usize];
            let found = &mut found_buf[..len as usize];
            self.render_slot(image, s, expected);
            memory.read(image.pool.base + start, found)?;
            checked += len;
            if expected != found {
                for (i, (&e, &f)) in expected.iter().zip(found.iter()).enumerate() {
                    if e == f {
                        continue;
                    }
                    report.mismatched_bytes += 1;
                    if report.mismatches.len() < oracle.max_mismatches {
                        report.mismatches.push(Mismatch {
                            side,
                            instance: self.info.instance_name.to_string(),
                            rank: self.info.instance_rank,
                            pool: image.index as u32,
                            offset: start + i as u64,
                            logical: self.describe(image, s, i as u64),
                            expected: e,
                            found: f,
                        });
                    }
                }
            }
        }
        Ok(checked)
    }

    fn describe(&self, image: &PoolImage, s: u64, off: u64) -> Logical {
        let padding = off >= image.pool.slot_bytes;
        if let Some(seg) = image.slots.get(&s).and_then(|segs| {
            segs.iter()
                .find(|g| (g.offset..g.offset + g.len).contains(&off))
        }) {
            return self.geoms[seg.geom].describe(seg.layer, seg.token0, off - seg.offset);
        }
        match image.background.kind {
            Background::Canary => Logical::Uncovered { slot: s, padding },
            Background::Foreign => Logical::Foreign { slot: s, padding },
        }
    }
}

fn add_segment(image: &mut PoolImage, slot: u64, geom: usize, layer: &LayerRange, token0: u64) {
    image.slots.entry(slot).or_default().push(Segment {
        offset: layer.offset,
        len: layer.size,
        geom,
        layer: layer.global,
        token0,
    });
}

/// Models every view of `info`'s page table.
fn model_views(salt: u64, info: &RankInfo) -> Result<Vec<ViewGeom>, OracleError> {
    let pt = &info.page_table;
    let tpb = u64::from(pt.tokens_per_block);
    let mut out = Vec::new();
    for (g, group) in pt.groups.iter().enumerate() {
        for (v, view) in group.views.iter().enumerate() {
            let at = |m: String| input_error(info, format!("group {g} view {v}: {m}"));
            let layers = view
                .layer_ranges(group)
                .map_err(|e| at(e.message().to_string()))?;
            let Some(first) = layers.first() else {
                continue;
            };
            let pool = pt
                .pools
                .get(view.pool as usize)
                .ok_or_else(|| at(format!("pool {} does not exist", view.pool)))?;
            if let Some(bad) = view
                .entries
                .iter()
                .find(|e| e.offset + e.size > pool.slot_bytes)
            {
                return Err(at(format!(
                    "entry at offset {} runs past the slot's {} bytes",
                    bad.offset, pool.slot_bytes
                )));
            }
            let buffers = u64::from(first.buffers);
            if first.size % buffers != 0
                || view.entries.iter().any(|e| e.size * buffers != first.size)
            {
                return Err(at("buffers of a layer differ in size".to_string()));
            }
            let buffer_bytes = first.size / buffers;
            let l = &view.layout;
            let paged = group.kind == GroupKind::PAGED;
            let tokens = if paged { tpb } else { 1 };
            let unsupported =
                |what: &str| at(format!("{} {what} views are not modelled", group.kind));
            let shape = match l.kind {
                LayoutKind::HND | LayoutKind::REPLICATED | LayoutKind::NHD => {
                    let replicated = l.kind == LayoutKind::REPLICATED;
                    let token_major = l.kind == LayoutKind::NHD;
                    if token_major && !paged {
                        return Err(unsupported("nhd"));
                    }
                    // Bytes of one head of one token.
                    let unit = if replicated || l.shard_unit_bytes == 0 {
                        buffer_bytes
                    } else {
                        l.shard_unit_bytes
                    };
                    let (heads, row) = if token_major {
                        let per_token = buffer_bytes / tokens;
                        let unit = if l.shard_unit_bytes == 0 {
                            per_token
                        } else {
                            l.shard_unit_bytes
                        };
                        if per_token * tokens != buffer_bytes || per_token % unit != 0 {
                            return Err(at(format!(
                                "a {buffer_bytes}-byte buffer is not {tokens} tokens of \
                                 {unit}-byte heads"
                            )));
                        }
                        (per_token / unit, unit)
                    } else {
                        if buffer_bytes % unit != 0 || unit % tokens != 0 {
                            return Err(at(format!(
                                "a {buffer_bytes}-byte buffer is not made of {unit}-byte heads \
                                 of {tokens} tokens"
                            )));
                        }
                        (buffer_bytes / unit, unit / tokens)
                    };
                    let head_base = if replicated {
                        0
                    } else {
                        u64::from(l.shard_index) * heads
                    };
                    Shape::Heads {
                        heads,
                        row,
                        head_base,
                        token_major,
                    }
                }
                LayoutKind::SECTIONED if !paged => Shape::Sections {
                    bytes: l.section_bytes.to_vec(),
                    shard: u64::from(l.shard_index),
                },
                LayoutKind::SECTIONED => return Err(unsupported("sectioned")),
                other => return Err(unsupported(&other.to_string())),
            };
            let roles = view
                .roles
                .iter()
                .map(|r| r.as_str())
                .collect::<Vec<_>>()
                .join(",");
            let roles_hash = fnv1a(roles.as_bytes());
            let kind_code = u64::from(group.kind.0);
            out.push(ViewGeom {
                group: g,
                view: v,
                kind: group.kind,
                pool: view.pool as usize,
                seed: combine(combine(salt, kind_code), roles_hash),
                roles,
                roles_hash,
                tpb,
                buffers,
                buffer_bytes,
                shape,
                layers,
            });
        }
    }
    Ok(out)
}

/// What the context side holds, by (group kind, roles, global layer).
struct ContextHoldings {
    tokens_per_block: Option<u64>,
    by_layer: HashMap<(u8, u64, u32), Holding>,
}

#[derive(Default)]
struct Holding {
    /// Held global ordinals (PAGED).
    ordinals: Vec<bool>,
    /// Whether a state slot is held (STATE).
    state: bool,
}

impl ContextHoldings {
    fn new(salt: u64, context: &[RequestSide<'_>]) -> Result<Self, OracleError> {
        let mut out = Self {
            tokens_per_block: None,
            by_layer: HashMap::new(),
        };
        for side in context {
            let model = RankModel::new(salt, side.info)?;
            model.check_tables(side.slot_tables)?;
            let tpb = u64::from(side.info.page_table.tokens_per_block);
            match out.tokens_per_block {
                Some(t) if t != tpb => {
                    return Err(input_error(
                        side.info,
                        format!("tokens_per_block {tpb} differs from other context ranks' {t}"),
                    ));
                }
                _ => out.tokens_per_block = Some(tpb),
            }
            for geom in &model.geoms {
                let id = (geom.group as u32, geom.view as u32);
                if side.excluded.iter().any(|e| (e.group, e.view) == id) {
                    continue;
                }
                let table = &side.slot_tables[geom.group];
                let held: Vec<u64> = table
                    .slots
                    .iter()
                    .enumerate()
                    .filter(|&(_, &s)| s != SlotTable::HOLE)
                    .map(|(j, _)| model.global_ordinal(j as u64))
                    .collect();
                for layer in &geom.layers {
                    let key = (geom.kind.0, geom.roles_hash, layer.global);
                    let h = out.by_layer.entry(key).or_default();
                    if geom.kind == GroupKind::STATE {
                        h.state |= !held.is_empty();
                        continue;
                    }
                    for &g in &held {
                        let g = g as usize;
                        if h.ordinals.len() <= g {
                            h.ordinals.resize(g + 1, false);
                        }
                        h.ordinals[g] = true;
                    }
                }
            }
        }
        Ok(out)
    }

    fn get(&self, kind: GroupKind, roles_hash: u64, layer: u32) -> Option<&Holding> {
        self.by_layer.get(&(kind.0, roles_hash, layer))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_is_addressable_at_any_byte() {
        let mut whole = vec![0u8; 100];
        stream(42, 3, &mut whole);
        for split in [0usize, 1, 5, 7, 8, 13, 99, 100] {
            let mut parts = vec![0u8; 100];
            let (a, b) = parts.split_at_mut(split);
            stream(42, 3, a);
            stream(42, 3 + split as u64, b);
            assert_eq!(parts, whole, "split at {split}");
        }
        let mut short = [0u8; 3];
        stream(42, 9, &mut short);
        assert_eq!(short, whole[6..9]);
        let mut other = vec![0u8; 100];
        stream(43, 3, &mut other);
        assert_ne!(other, whole);
    }

    #[test]
    fn memory_resolves_inside_pools_only() {
        let mut m = LocalMemory::new();
        let a = m.allocate(100, "a");
        let b = m.reserve(50, "b");
        assert!(b >= a + 100 + POOL_ALIGN);
        assert!(m.bytes(a, 100).is_ok());
        assert!(matches!(
            m.bytes(a + 90, 20),
            Err(MemoryError::PastEnd { .. })
        ));
        assert!(matches!(
            m.bytes(a + 100, 1),
            Err(MemoryError::Unmapped { .. })
        ));
        assert!(matches!(
            m.bytes(a - 1, 1),
            Err(MemoryError::Unmapped { .. })
        ));
        assert!(matches!(m.bytes(b, 1), Err(MemoryError::NotBacked { .. })));
        m.back(b).unwrap();
        assert!(m.is_backed(b));
        assert_eq!(m.backed_bytes(), 150);
        assert_eq!(m.back(b + 1), Err(MemoryError::NoPoolAt(b + 1)));
    }
}
