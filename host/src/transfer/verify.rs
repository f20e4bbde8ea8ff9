//! The oracle on UCX pools: fill a request's source slots, prime destination slots with the
//! canary, check a request's destination slots, check idle pools.
//!
//! Every oracle call of the transfer code goes through this module. The oracle works on
//! [`LocalMemory`], so each call stages the bytes it needs through a *mirror*: a
//! `LocalMemory` holding the pools of one rank truncated to the highest slot the call touches
//! (slot offsets, and so the canary and tag streams, are unchanged). Filling and priming
//! render the whole mirror and copy only the request's slots into the pools; checking primes
//! the mirror with the canary, copies only the request's slots out of the pools and checks
//! the mirror, so bytes of other requests in flight never enter the verdict.

use std::collections::BTreeSet;

use kvferry_planner_abi::{PairRequest, RankInfo, SlotTable, ViewId};

use super::memory::RankPools;
use crate::oracle::{Delivery, LocalMemory, MemoryError, Oracle, OracleError, VerifyReport};
use crate::plan::RequestSide;

/// Why the oracle could not fill or check UCX pools.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// The oracle refused the geometry or the slot tables.
    #[error(transparent)]
    Oracle(#[from] OracleError),
    /// A mirror could not be addressed.
    #[error(transparent)]
    Mirror(#[from] MemoryError),
    /// A slot table names a slot outside its pool.
    #[error("rank {rank}: slot {slot} is outside pool {pool} of {slots} slots")]
    SlotOutside {
        /// The rank.
        rank: u32,
        /// The pool.
        pool: usize,
        /// The slot.
        slot: i64,
        /// Slots of the pool.
        slots: u64,
    },
}

/// One receiver rank of a request, for [`verify_request`].
#[derive(Clone, Copy, Debug)]
pub struct ReceiverPart<'a> {
    /// The rank.
    pub info: &'a RankInfo,
    /// Its pools.
    pub pools: &'a RankPools,
    /// Its slot tables for the request.
    pub tables: &'a [SlotTable],
    /// Views it excluded.
    pub excluded: &'a [ViewId],
}

/// Writes the canary over every byte of every pool of a rank (once, at start).
///
/// # Errors
///
/// The oracle cannot model the rank.
pub fn prime_all(oracle: &Oracle, info: &RankInfo, pools: &RankPools) -> Result<(), VerifyError> {
    let full: Vec<u64> = info.page_table.pools.iter().map(|p| p.num_slots).collect();
    for p in 0..full.len() {
        let mut extent = vec![0; full.len()];
        extent[p] = full[p];
        let mut memory = LocalMemory::new();
        let mirror = mirror(&mut memory, info, &extent, true)?;
        oracle.prime_destination(&mut memory, &mirror)?;
        let slots: BTreeSet<u64> = (0..full[p]).collect();
        copy_in(&memory, &mirror, pools, p, &slots)?;
    }
    Ok(())
}

/// Writes the canary over a request's slots of a receiver rank.
///
/// # Errors
///
/// The oracle cannot model the rank, or a table names a slot outside its pool.
pub fn prime_slots(
    oracle: &Oracle,
    info: &RankInfo,
    pools: &RankPools,
    tables: &[SlotTable],
) -> Result<(), VerifyError> {
    let held = held_slots(info, tables)?;
    let mut memory = LocalMemory::new();
    let mirror = mirror(&mut memory, info, &extent(&held), true)?;
    oracle.prime_destination(&mut memory, &mirror)?;
    for (p, slots) in held.iter().enumerate() {
        copy_in(&memory, &mirror, pools, p, slots)?;
    }
    Ok(())
}

/// Writes a request's logical tags into its slots of a sender rank (the demo's "prefill").
///
/// # Errors
///
/// The oracle cannot model the rank, or a table names a slot outside its pool.
pub fn fill_slots(
    oracle: &Oracle,
    info: &RankInfo,
    pools: &RankPools,
    tables: &[SlotTable],
) -> Result<(), VerifyError> {
    let held = held_slots(info, tables)?;
    let mut memory = LocalMemory::new();
    let mirror = mirror(&mut memory, info, &extent(&held), true)?;
    oracle.fill_source(&mut memory, RequestSide::new(&mirror, tables))?;
    for (p, slots) in held.iter().enumerate() {
        copy_in(&memory, &mirror, pools, p, slots)?;
    }
    Ok(())
}

/// Checks a completed request's slots on every receiver rank: covered bytes hold their tags,
/// the rest of those slots still hold the canary.
///
/// `context` is every rank of the context DP group that served the request, with its slot
/// tables; `pieces` every piece the senders planned.
///
/// # Errors
///
/// The oracle cannot model a rank, or a table names a slot outside its pool. Mismatches are
/// in the report.
pub fn verify_request(
    oracle: &Oracle,
    receivers: &[ReceiverPart<'_>],
    context: &[(&RankInfo, &[SlotTable])],
    pieces: &[PairRequest],
) -> Result<VerifyReport, VerifyError> {
    let mut memory = LocalMemory::new();
    let mut receiver_infos = Vec::with_capacity(receivers.len());
    for part in receivers {
        let held = held_slots(part.info, part.tables)?;
        let mirror = mirror(&mut memory, part.info, &extent(&held), true)?;
        oracle.prime_destination(&mut memory, &mirror)?;
        for (p, slots) in held.iter().enumerate() {
            copy_out(&mut memory, &mirror, part.pools, p, slots)?;
        }
        receiver_infos.push(mirror);
    }
    let mut context_infos = Vec::with_capacity(context.len());
    for (info, _) in context {
        let full: Vec<u64> = info.page_table.pools.iter().map(|p| p.num_slots).collect();
        // Reserved, never backed: the oracle reads their geometry only.
        context_infos.push(mirror(&mut memory, info, &full, false)?);
    }
    let receiver_sides: Vec<RequestSide<'_>> = receivers
        .iter()
        .zip(&receiver_infos)
        .map(|(part, info)| RequestSide {
            info,
            slot_tables: part.tables,
            excluded: part.excluded,
        })
        .collect();
    let context_sides: Vec<RequestSide<'_>> = context
        .iter()
        .zip(&context_infos)
        .map(|((_, tables), info)| RequestSide::new(info, tables))
        .collect();
    Ok(oracle.verify(
        &memory,
        &Delivery {
            context: &context_sides,
            receivers: &receiver_sides,
            pieces,
        },
    )?)
}

/// Checks that every byte of every pool of the ranks holds its canary (no request holds a
/// slot).
///
/// # Errors
///
/// The oracle cannot model a rank.
pub fn verify_idle(
    oracle: &Oracle,
    ranks: &[(&RankInfo, &RankPools)],
) -> Result<VerifyReport, VerifyError> {
    let mut total = VerifyReport::default();
    for (info, pools) in ranks {
        let full: Vec<u64> = info.page_table.pools.iter().map(|p| p.num_slots).collect();
        let empty: Vec<SlotTable> = info
            .page_table
            .groups
            .iter()
            .map(|_| SlotTable::default())
            .collect();
        for p in 0..full.len() {
            let mut extent = vec![0; full.len()];
            extent[p] = full[p];
            let mut memory = LocalMemory::new();
            let mirror = mirror(&mut memory, info, &extent, true)?;
            let slots: BTreeSet<u64> = (0..full[p]).collect();
            copy_out(&mut memory, &mirror, pools, p, &slots)?;
            let side = [RequestSide::new(&mirror, &empty)];
            let report = oracle.verify(
                &memory,
                &Delivery {
                    context: &[],
                    receivers: &side,
                    pieces: &[],
                },
            )?;
            merge(&mut total, report);
        }
    }
    Ok(total)
}

fn merge(total: &mut VerifyReport, report: VerifyReport) {
    total.bytes_checked += report.bytes_checked;
    total.bytes_covered += report.bytes_covered;
    total.source_bytes_checked += report.source_bytes_checked;
    total.mismatched_bytes += report.mismatched_bytes;
    let room = 16usize.saturating_sub(total.mismatches.len());
    total
        .mismatches
        .extend(report.mismatches.into_iter().take(room));
}

/// The slots `tables` hold in each pool of `info`.
fn held_slots(info: &RankInfo, tables: &[SlotTable]) -> Result<Vec<BTreeSet<u64>>, VerifyError> {
    let pt = &info.page_table;
    let mut held = vec![BTreeSet::new(); pt.pools.len()];
    for (group, table) in pt.groups.iter().zip(tables) {
        for view in group.views.iter() {
            let p = view.pool as usize;
            let Some(pool) = pt.pools.get(p) else {
                continue;
            };
            for &slot in table.slots.iter().filter(|&&s| s != SlotTable::HOLE) {
                if slot < 0 || slot as u64 >= pool.num_slots {
                    return Err(VerifyError::SlotOutside {
                        rank: info.instance_rank,
                        pool: p,
                        slot,
                        slots: pool.num_slots,
                    });
                }
                held[p].insert(slot as u64);
            }
        }
    }
    Ok(held)
}

/// Slots a mirror of each pool needs: one past the highest held slot.
fn extent(held: &[BTreeSet<u64>]) -> Vec<u64> {
    held.iter()
        .map(|s| s.last().map_or(0, |&m| m + 1))
        .collect()
}

/// `info` with pool `p` truncated to `extent[p]` slots and placed in `memory` (backed if
/// `back`).
fn mirror(
    memory: &mut LocalMemory,
    info: &RankInfo,
    extent: &[u64],
    back: bool,
) -> Result<RankInfo, VerifyError> {
    let mut mirror = info.clone();
    for (p, pool) in mirror.page_table.pools.iter_mut().enumerate() {
        pool.num_slots = extent.get(p).copied().unwrap_or(0);
        let bytes = pool.footprint();
        pool.base = memory.reserve(
            bytes,
            format!(
                "mirror of {} rank {} pool {p}",
                info.instance_name, info.instance_rank
            ),
        );
        if back {
            memory.back(pool.base)?;
        }
    }
    Ok(mirror)
}

/// The byte range of slot `s` in a mirror pool: the slot and its padding, clipped to the
/// mirror's footprint.
fn span(mirror: &RankInfo, p: usize, s: u64) -> Option<(u64, u64)> {
    let pool = mirror.page_table.pools.get(p)?;
    let start = s * pool.slot_stride;
    let end = (start + pool.slot_stride).min(pool.footprint());
    (end > start).then_some((start, end - start))
}

/// Copies slots of mirror pool `p` into the real pool.
fn copy_in(
    memory: &LocalMemory,
    mirror: &RankInfo,
    pools: &RankPools,
    p: usize,
    slots: &BTreeSet<u64>,
) -> Result<(), VerifyError> {
    let base = mirror.page_table.pools[p].base;
    for &s in slots {
        let Some((start, len)) = span(mirror, p, s) else {
            continue;
        };
        let bytes = memory.bytes(base + start, len)?;
        // SAFETY: the slots belong to a request this host has not handed to any writer yet
        // (filling, priming) or to no request at all (start-up): no put reads them and no
        // peer writes them (see the memory module's slot ownership).
        unsafe { pools.write(p, start as usize, bytes) };
    }
    Ok(())
}

/// Copies slots of the real pool `p` into the mirror.
fn copy_out(
    memory: &mut LocalMemory,
    mirror: &RankInfo,
    pools: &RankPools,
    p: usize,
    slots: &BTreeSet<u64>,
) -> Result<(), VerifyError> {
    let base = mirror.page_table.pools[p].base;
    for &s in slots {
        let Some((start, len)) = span(mirror, p, s) else {
            continue;
        };
        let bytes = memory.bytes_mut(base + start, len)?;
        pools.read(p, start as usize, bytes);
    }
    Ok(())
}
