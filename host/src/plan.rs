//! Planning one piece of a request: describe both sides, ask the planner, validate, coalesce.
//!
//! A planner is trusted to compute, never to address memory: every fragment it returns is
//! checked against the rows both sides described before a byte moves. Only a
//! [`ValidatedPlan`] reaches an executor, and the only way to get one is [`validate`] (or
//! [`plan_transfer`], which calls it).
//!
//! # Rules
//!
//! For a plan `(src[k], dst[k], len[k])`:
//!
//! 1. the three arrays have the same length;
//! 2. no fragment has length 0, and neither `src + len` nor `dst + len` overflows;
//! 3. every source range lies inside this rank's rows for the request, every destination range
//!    inside the peer's rows for the request. The rows of one side are the default
//!    describer's rows over all its (non-excluded) views: `[address, address + row_bytes)` per
//!    row. A fragment may run across several rows only where they are byte-adjacent (a pool
//!    whose `slot_stride == slot_bytes`, consecutive slots both held by the request) — this is
//!    what row-merging planners emit. It may never cover padding or a slot the request does
//!    not hold;
//! 4. no two destination ranges overlap (each destination byte has one writer per plan).
//!
//! Then adjacent fragments — source and destination both continuing the previous fragment, in
//! plan order — are merged into one. Checking is `O(n log n)` in the number of fragments.
//!
//! Rows are whole slots: bytes of an excluded view that share a slot with a described view
//! are not told apart here (the oracle's canary check catches writes into them).

use std::fmt;

use kvferry_planner_abi::{
    LayerGroupRows, PairRequest, PlanError, RankInfo, SlotTable, TransferPlan, TransferPlanner,
    ViewId, rows,
};

/// One rank's part in a request: its description, its slot tables and its excluded views.
#[derive(Clone, Copy, Debug)]
pub struct RequestSide<'a> {
    /// The rank.
    pub info: &'a RankInfo,
    /// One slot table per layer group of the rank's page table.
    pub slot_tables: &'a [SlotTable],
    /// Views this rank neither sends nor receives for the request.
    pub excluded: &'a [ViewId],
}

impl<'a> RequestSide<'a> {
    /// A side without excluded views.
    pub fn new(info: &'a RankInfo, slot_tables: &'a [SlotTable]) -> Self {
        Self {
            info,
            slot_tables,
            excluded: &[],
        }
    }

    /// The default describer's rows of this side.
    ///
    /// # Errors
    ///
    /// Whatever [`kvferry_planner_abi::rows`] refuses.
    pub fn rows(&self) -> Result<Vec<LayerGroupRows>, PlanError> {
        rows(&self.info.page_table, self.slot_tables, self.excluded)
    }
}

/// Why no validated plan came out of [`plan_transfer`].
#[derive(Debug, thiserror::Error)]
pub enum PlanFailure {
    /// The describer refused this rank's slot tables.
    #[error("describing this rank's rows: {0}")]
    DescribeLocal(PlanError),
    /// The describer refused the peer's slot tables.
    #[error("describing the peer's rows: {0}")]
    DescribePeer(PlanError),
    /// The planner returned an error.
    #[error("planner: {0}")]
    Planner(PlanError),
    /// The planner's plan broke a rule.
    #[error("plan rejected: {0}")]
    Rejected(#[from] PlanRejected),
}

/// Which side of a fragment a rule concerns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// The source (this rank).
    Source,
    /// The destination (the peer).
    Destination,
}

impl fmt::Display for End {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            End::Source => "source",
            End::Destination => "destination",
        })
    }
}

/// A plan that broke a validation rule, naming the fragment.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanRejected {
    /// The structure-of-arrays lengths differ.
    #[error("plan arrays differ in length: {src} sources, {dst} destinations, {len} lengths")]
    LengthMismatch {
        /// Entries of `src`.
        src: usize,
        /// Entries of `dst`.
        dst: usize,
        /// Entries of `len`.
        len: usize,
    },
    /// A fragment of length 0.
    #[error("fragment {fragment}: zero length")]
    ZeroLength {
        /// Index of the fragment in the plan.
        fragment: usize,
    },
    /// `address + len` overflows.
    #[error("fragment {fragment}: {end} {address:#x} +{len} overflows the address space")]
    Overflow {
        /// Index of the fragment in the plan.
        fragment: usize,
        /// Which address overflows.
        end: End,
        /// The address.
        address: u64,
        /// The length.
        len: u64,
    },
    /// A range outside the rows of its side.
    #[error("fragment {fragment}: {end} {address:#x} +{len} lies outside {} rows for this request", match end { End::Source => "this rank's", End::Destination => "the peer's" })]
    OutsideRows {
        /// Index of the fragment in the plan.
        fragment: usize,
        /// Which side.
        end: End,
        /// Start of the range.
        address: u64,
        /// Length of the range.
        len: u64,
    },
    /// Two destination ranges overlap.
    #[error(
        "fragments {first} and {second}: destinations {first_address:#x} +{first_len} and \
         {second_address:#x} +{second_len} overlap"
    )]
    OverlappingDestinations {
        /// The lower fragment index.
        first: usize,
        /// Its destination.
        first_address: u64,
        /// Its length.
        first_len: u64,
        /// The higher fragment index.
        second: usize,
        /// Its destination.
        second_address: u64,
        /// Its length.
        second_len: u64,
    },
}

impl PlanRejected {
    /// The (first) fragment the rule names, if any.
    pub fn fragment(&self) -> Option<usize> {
        match *self {
            PlanRejected::LengthMismatch { .. } => None,
            PlanRejected::ZeroLength { fragment }
            | PlanRejected::Overflow { fragment, .. }
            | PlanRejected::OutsideRows { fragment, .. } => Some(fragment),
            PlanRejected::OverlappingDestinations { first, .. } => Some(first),
        }
    }
}

/// A plan that passed [`validate`], with adjacent fragments coalesced.
///
/// Opaque: an executor may trust that every source lies in the sender's rows and every
/// destination in the receiver's rows for the request, without overlap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidatedPlan {
    src: Vec<u64>,
    dst: Vec<u64>,
    len: Vec<u64>,
    planned: usize,
    total: u64,
}

impl ValidatedPlan {
    /// The `(src, dst, len)` fragments after coalescing, in plan order.
    pub fn fragments(&self) -> impl ExactSizeIterator<Item = (u64, u64, u64)> + '_ {
        (0..self.len.len()).map(|k| (self.src[k], self.dst[k], self.len[k]))
    }

    /// Fragments after coalescing.
    pub fn len(&self) -> usize {
        self.len.len()
    }

    /// Whether the plan moves nothing (the sender still reports completion).
    pub fn is_empty(&self) -> bool {
        self.len.is_empty()
    }

    /// Fragments the planner returned, before coalescing.
    pub fn planned_fragments(&self) -> usize {
        self.planned
    }

    /// Bytes the plan moves.
    pub fn total_bytes(&self) -> u64 {
        self.total
    }

    /// Source addresses, one per fragment.
    pub fn src(&self) -> &[u64] {
        &self.src
    }

    /// Destination addresses, one per fragment.
    pub fn dst(&self) -> &[u64] {
        &self.dst
    }

    /// Fragment lengths.
    pub fn lens(&self) -> &[u64] {
        &self.len
    }
}

/// Plans one piece of a request from `me` (the sender) to `peer`: describes both sides with
/// the default describer, asks `planner.pair`, then [`validate`]s and coalesces the result.
///
/// # Errors
///
/// A describer refusal on either side, a planner error, or the first broken rule.
pub fn plan_transfer(
    planner: &dyn TransferPlanner,
    me: RequestSide<'_>,
    peer: RequestSide<'_>,
    request: &PairRequest,
) -> Result<ValidatedPlan, PlanFailure> {
    let my_rows = me.rows().map_err(PlanFailure::DescribeLocal)?;
    let peer_rows = peer.rows().map_err(PlanFailure::DescribePeer)?;
    let plan = planner
        .pair(me.info, peer.info, &my_rows, &peer_rows, request)
        .map_err(PlanFailure::Planner)?;
    Ok(validate(&plan, &my_rows, &peer_rows)?)
}

/// Checks `plan` against the rows of both sides (see the module's rules) and coalesces it.
///
/// # Errors
///
/// The first broken rule: array lengths; then, fragment by fragment in plan order, zero
/// length, overflow, source outside `my_rows`, destination outside `peer_rows`; then
/// overlapping destinations (the pair with the lowest destination address).
pub fn validate(
    plan: &TransferPlan,
    my_rows: &[LayerGroupRows],
    peer_rows: &[LayerGroupRows],
) -> Result<ValidatedPlan, PlanRejected> {
    let (src, dst, len) = (&plan.src, &plan.dst, &plan.len);
    if src.len() != dst.len() || dst.len() != len.len() {
        return Err(PlanRejected::LengthMismatch {
            src: src.len(),
            dst: dst.len(),
            len: len.len(),
        });
    }
    let mine = Extents::of(my_rows);
    let theirs = Extents::of(peer_rows);
    for k in 0..len.len() {
        let n = len[k];
        if n == 0 {
            return Err(PlanRejected::ZeroLength { fragment: k });
        }
        for (end, address, extents) in [
            (End::Source, src[k], &mine),
            (End::Destination, dst[k], &theirs),
        ] {
            if address.checked_add(n).is_none() {
                return Err(PlanRejected::Overflow {
                    fragment: k,
                    end,
                    address,
                    len: n,
                });
            }
            if !extents.contains(address, n) {
                return Err(PlanRejected::OutsideRows {
                    fragment: k,
                    end,
                    address,
                    len: n,
                });
            }
        }
    }
    check_overlap(dst, len)?;
    Ok(coalesce(plan))
}

/// The bytes one side holds for a request: sorted, merged `[start, end)` intervals.
struct Extents(Vec<(u64, u64)>);

impl Extents {
    fn of(rows: &[LayerGroupRows]) -> Self {
        let mut spans: Vec<(u64, u64)> = rows
            .iter()
            .flat_map(|r| {
                r.addresses
                    .iter()
                    .map(move |&a| (a, a.saturating_add(r.row_bytes)))
            })
            .filter(|(a, b)| a < b)
            .collect();
        spans.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(spans.len());
        for (a, b) in spans {
            match merged.last_mut() {
                // Overlapping (two views of one pool) or byte-adjacent rows join.
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        Extents(merged)
    }

    /// Whether `[address, address + len)` lies inside one merged interval.
    fn contains(&self, address: u64, len: u64) -> bool {
        let i = self.0.partition_point(|&(a, _)| a <= address);
        i > 0 && {
            let (_, b) = self.0[i - 1];
            address + len <= b
        }
    }
}

fn check_overlap(dst: &[u64], len: &[u64]) -> Result<(), PlanRejected> {
    let mut order: Vec<usize> = (0..dst.len()).collect();
    order.sort_unstable_by_key(|&k| (dst[k], k));
    // The fragment reaching furthest so far, and its end.
    let mut reach: Option<(usize, u64)> = None;
    for k in order {
        if let Some((j, end)) = reach {
            if dst[k] < end {
                let (first, second) = (j.min(k), j.max(k));
                return Err(PlanRejected::OverlappingDestinations {
                    first,
                    first_address: dst[first],
                    first_len: len[first],
                    second,
                    second_address: dst[second],
                    second_len: len[second],
                });
            }
        }
        let end = dst[k] + len[k];
        if reach.is_none_or(|(_, e)| end > e) {
            reach = Some((k, end));
        }
    }
    Ok(())
}

fn coalesce(plan: &TransferPlan) -> ValidatedPlan {
    let mut out = ValidatedPlan {
        src: Vec::new(),
        dst: Vec::new(),
        len: Vec::new(),
        planned: plan.fragments(),
        total: 0,
    };
    for (s, d, n) in plan.iter() {
        out.total += n;
        if let (Some(ls), Some(ld), Some(ln)) = (out.src.last(), out.dst.last(), out.len.last_mut())
        {
            if *ls + *ln == s && *ld + *ln == d {
                *ln += n;
                continue;
            }
        }
        out.src.push(s);
        out.dst.push(d);
        out.len.push(n);
    }
    out
}
