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
//! whose global layer some prefill rank holds in a view of the same group kind and role set
//! (non-excluded), and
//! - PAGED: its ordinal lies in a requested piece, the receiver table holds a slot there and
//!   the prefill side holds the same global ordinal (helix: local ordinal `j` of CP rank `r`
//!   of `C` is global ordinal `j × C + r`);
//! - STATE: both sides hold a slot and the request's last piece was sent.
//!
//! When the two sides' `tokens_per_block` differ (one a multiple of the other, semantics §3.2
//! rule 4), PAGED coverage is decided per block of the smaller side: a unit is covered when a
//! piece requests it (`[start / small, ceil(end / small))`, from the receiver block holding
//! `dst_start_token` on), the receiver holds the block it lies in and the prefill side holds
//! the block it lies in; the uncovered tokens of a partly covered receiver block keep their
//! canary.
//!
//! # Code
//!
//! `memory`: the pools ([`PoolMemory`], [`LocalMemory`]); `tags`: the hash streams and the
//! canary and foreign backgrounds; `geometry`: each view's runs, read off the page table;
//! `image`: a pool's expected content, rendered to fill and to check; `coverage`: what a
//! delivery must have written; `report`: mismatches and the verdict.
//!
//! [`ValidatedPlan`]: kvferry_plan::ValidatedPlan

mod coverage;
mod geometry;
mod image;
mod memory;
mod report;
mod tags;

use kvferry_planner_abi::{PairRequest, PlanError, RankInfo};

use kvferry_plan::RequestSide;

pub use memory::{LocalMemory, MemoryError, PoolMemory};
pub use report::{Logical, Mismatch, Side, VerifyReport};

use coverage::PrefillHoldings;
use image::{PoolImage, RankModel};
use tags::{Background, BackgroundSeed, combine, fnv1a};

/// Which slots of a pool an oracle call touches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Extent {
    /// Every byte of every pool.
    WholePools,
    /// Only the slots the request's slot tables name (the request's own bytes, padding
    /// included), so requests sharing a pool can be filled and checked independently.
    RequestSlots,
}

/// Why the oracle could not fill or check.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
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
    /// A view's layers cannot be derived from its group; the page table's check is the
    /// `source()`.
    #[error("{instance} rank {rank}: group {group} view {view}: cannot derive its layers")]
    ViewLayers {
        /// The rank's instance.
        instance: String,
        /// The rank.
        rank: u32,
        /// The layer group.
        group: usize,
        /// The view in the group.
        view: usize,
        /// Why not.
        #[source]
        source: PlanError,
    },
}

fn input_error(info: &RankInfo, message: impl Into<String>) -> OracleError {
    OracleError::Input {
        instance: info.instance_name.to_string(),
        rank: info.instance_rank,
        message: message.into(),
    }
}

/// What a request was meant to deliver, for [`Oracle::verify`].
#[derive(Clone, Copy, Debug)]
pub struct Delivery<'a> {
    /// Every rank of the prefill DP group that served the request, with its slot tables. Their
    /// page tables decide coverage; the backed pools among them are checked to be unchanged.
    pub prefill: &'a [RequestSide<'a>],
    /// Every receiver rank of the decode DP group, with its slot tables.
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
        let held = PrefillHoldings::new(self.salt, delivery.prefill)?;
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
        for sender in delivery.prefill {
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
