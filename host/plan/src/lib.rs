//! kvferry-plan: sans-IO planning — describe both sides, ask the planner, validate, coalesce,
//! size bounce regions. No sockets, no UCX, no unsafe.
//!
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
//! 1. the three arrays have the same length, below 2^32;
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
//! plan order — are merged into one. Checking is `O(n log b)` for `n` fragments, `b` being the
//! most fragments that start in one destination row (linear when each row's fragments come
//! in ascending order, as the shipped planners emit them).
//!
//! A compressed plan ([`kvferry_planner_abi::CompressedPlan`]: fragment patterns applied to
//! row pairs) is checked by [`validate_compressed`] against the same rows, pattern by
//! pattern and row pair by row pair, without expanding it; it then stays compressed, and
//! [`ValidatedPlan::fragments`] expands it as an executor reads it.
//!
//! Rows are whole slots: bytes of an excluded view that share a slot with a described view
//! are not told apart here (the oracle's canary check catches writes into them).

#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod bounce;
mod compressed;
mod tables;

pub use compressed::{WriterOverlap, overlapping_writers, validate_compressed};
pub use tables::{blocks_needed, check_slot_tables};

use std::collections::BTreeSet;
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

/// The views a layer-wise piece names, as a set: at least one, each one of `all` (the
/// rank's views, [`kvferry_planner_abi::PageTable::view_ids`]), none twice; or why not.
///
/// # Errors
///
/// An empty list, a view the rank does not have, or one named twice.
pub fn carried_views(all: &BTreeSet<ViewId>, views: &[ViewId]) -> Result<BTreeSet<ViewId>, String> {
    if views.is_empty() {
        return Err("a layer-wise piece names no view (pass None for every view)".into());
    }
    let mut set = BTreeSet::new();
    for v in views {
        if !all.contains(v) {
            return Err(format!(
                "view (group {}, view {}) is not a view of this rank's page table",
                v.group, v.view
            ));
        }
        if !set.insert(*v) {
            return Err(format!(
                "view (group {}, view {}) is named twice",
                v.group, v.view
            ));
        }
    }
    Ok(set)
}

/// The views of `info` that a layer-wise piece carrying `views` leaves out: the `excluded` of
/// its [`RequestSide`] (see [`carried_views`]).
///
/// # Errors
///
/// As [`carried_views`].
pub fn excluded_views(info: &RankInfo, views: &[ViewId]) -> Result<Vec<ViewId>, String> {
    let all: BTreeSet<ViewId> = info.page_table.view_ids().collect();
    let carried = carried_views(&all, views)?;
    Ok(all.difference(&carried).copied().collect())
}

/// Why no validated plan came out of [`plan_transfer`].
///
/// The message says which step failed; the describer's or planner's error, or the broken
/// rule, is the `source()`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlanFailure {
    /// The describer refused this rank's slot tables.
    #[error("cannot describe this rank's rows")]
    DescribeLocal(#[source] PlanError),
    /// The describer refused the peer's slot tables.
    #[error("cannot describe the peer's rows")]
    DescribePeer(#[source] PlanError),
    /// The planner returned an error.
    #[error("the planner failed")]
    Planner(#[source] PlanError),
    /// The planner's plan broke a rule.
    #[error("plan rejected")]
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
#[non_exhaustive]
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
    /// More fragments than one plan may hold (2^32 - 1, some 100 GB of plan arrays).
    #[error("plan has {fragments} fragments; one plan holds at most 4,294,967,295")]
    TooManyFragments {
        /// Fragments in the plan.
        fragments: usize,
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
    /// A compressed plan's pattern has arrays of different lengths.
    #[error("pattern {pattern}: its {what} arrays differ in length")]
    PatternLengthMismatch {
        /// Index of the pattern.
        pattern: usize,
        /// Which arrays: `fragment` (offsets and lengths) or `row-pair`.
        what: &'static str,
    },
    /// A pattern names a rows entry the side does not have.
    #[error("pattern {pattern}: {end} rows entry {entry} does not exist ({entries} entries)")]
    PatternEntry {
        /// Index of the pattern.
        pattern: usize,
        /// Which side.
        end: End,
        /// The entry named.
        entry: u32,
        /// Entries the side has.
        entries: usize,
    },
    /// A pattern fragment of length 0.
    #[error("pattern {pattern} fragment {fragment}: zero length")]
    PatternZeroLength {
        /// Index of the pattern.
        pattern: usize,
        /// Index of the fragment in the pattern.
        fragment: usize,
    },
    /// A pattern fragment that does not lie inside one row.
    #[error(
        "pattern {pattern} fragment {fragment}: {end} offset {offset} +{len} lies outside the \
         {row_bytes}-byte row"
    )]
    PatternOutsideRow {
        /// Index of the pattern.
        pattern: usize,
        /// Index of the fragment in the pattern.
        fragment: usize,
        /// Which side.
        end: End,
        /// Offset inside the row.
        offset: u64,
        /// Length.
        len: u64,
        /// Bytes of the side's rows.
        row_bytes: u64,
    },
    /// A row pair naming a row the side does not hold for the request.
    #[error("pattern {pattern} row pair {pair}: {end} row {row} does not exist ({rows} rows)")]
    PatternMissingRow {
        /// Index of the pattern.
        pattern: usize,
        /// Index of the row pair in the pattern.
        pair: usize,
        /// Which side.
        end: End,
        /// The row named.
        row: u32,
        /// Rows of the entry.
        rows: usize,
    },
    /// A row whose address plus its size passes 2^64.
    #[error("pattern {pattern} row pair {pair}: {end} row at {address:#x} runs past 2^64")]
    PatternRowOverflow {
        /// Index of the pattern.
        pattern: usize,
        /// Index of the row pair in the pattern.
        pair: usize,
        /// Which side.
        end: End,
        /// The row's address.
        address: u64,
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
    /// The (first) fragment the rule names, if any: an index into the flat plan, or into the
    /// expansion of a compressed plan (`None` for the rules a compressed plan breaks before
    /// any fragment exists).
    pub fn fragment(&self) -> Option<usize> {
        match *self {
            PlanRejected::LengthMismatch { .. } | PlanRejected::TooManyFragments { .. } => None,
            PlanRejected::ZeroLength { fragment }
            | PlanRejected::Overflow { fragment, .. }
            | PlanRejected::OutsideRows { fragment, .. } => Some(fragment),
            PlanRejected::OverlappingDestinations { first, .. } => Some(first),
            PlanRejected::PatternLengthMismatch { .. }
            | PlanRejected::PatternEntry { .. }
            | PlanRejected::PatternZeroLength { .. }
            | PlanRejected::PatternOutsideRow { .. }
            | PlanRejected::PatternMissingRow { .. }
            | PlanRejected::PatternRowOverflow { .. } => None,
        }
    }
}

/// A plan that passed [`validate`] or [`validate_compressed`], with adjacent fragments
/// coalesced.
///
/// Opaque: an executor may trust that every source lies in the sender's rows and every
/// destination in the receiver's rows for the request, without overlap. A compressed plan
/// stays compressed: [`fragments`](Self::fragments) expands it as it is read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidatedPlan {
    form: Form,
    /// Fragments after coalescing.
    fragments: usize,
    planned: usize,
    total: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Form {
    /// The planner's flat plan, coalesced in place (no copy of a large plan).
    Flat(TransferPlan),
    /// A compressed plan with its rows resolved to addresses.
    Patterns(Vec<compressed::Resolved>),
}

impl ValidatedPlan {
    /// The `(src, dst, len)` fragments after coalescing, in plan order.
    pub fn fragments(&self) -> Fragments<'_> {
        let inner = match &self.form {
            Form::Flat(plan) => FragmentsInner::Flat { plan, next: 0 },
            Form::Patterns(patterns) => FragmentsInner::Patterns(compressed::Expand::new(patterns)),
        };
        Fragments {
            inner,
            remaining: self.fragments,
        }
    }

    /// Fragments after coalescing.
    pub fn len(&self) -> usize {
        self.fragments
    }

    /// Whether the plan moves nothing (the sender still reports completion).
    pub fn is_empty(&self) -> bool {
        self.fragments == 0
    }

    /// Fragments the planner returned, before coalescing (for a compressed plan, those of
    /// its expansion).
    pub fn planned_fragments(&self) -> usize {
        self.planned
    }

    /// Bytes the plan moves.
    pub fn total_bytes(&self) -> u64 {
        self.total
    }

    /// Whether the planner returned the plan in compressed form.
    pub fn is_compressed(&self) -> bool {
        matches!(self.form, Form::Patterns(_))
    }

    /// The plan as patterns, for an executor other than kvferry's (NIXL, Mooncake, an
    /// engine's own copy loop): every fragment of pattern `p` lands once per row pair of `p`,
    /// at `(src row + src offset, dst row + dst offset, len)`. A compressed plan keeps its
    /// patterns (coalesced); a flat plan is one pattern whose only row pair is `(0, 0)`, so
    /// its offsets are the addresses. [`fragments`](Self::fragments) is their expansion, in
    /// the same order.
    pub fn patterns(&self) -> Vec<Pattern> {
        match &self.form {
            Form::Flat(plan) => vec![Pattern {
                fragments: (0..plan.len.len())
                    .map(|k| (plan.src[k], plan.dst[k], plan.len[k]))
                    .collect(),
                rows: vec![(0, 0)],
            }],
            Form::Patterns(patterns) => {
                patterns.iter().map(compressed::Resolved::pattern).collect()
            }
        }
    }
}

/// One pattern of a [`ValidatedPlan`] ([`ValidatedPlan::patterns`]): fragments inside a
/// pair of rows, applied to each row pair.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pattern {
    /// `(source offset, destination offset, length)` inside a row pair, coalesced.
    pub fragments: Vec<(u64, u64, u64)>,
    /// `(source row address, destination row address)`, one per row pair it applies to.
    pub rows: Vec<(u64, u64)>,
}

/// The fragments of a [`ValidatedPlan`], in plan order: see [`ValidatedPlan::fragments`].
#[derive(Debug)]
pub struct Fragments<'a> {
    inner: FragmentsInner<'a>,
    remaining: usize,
}

#[derive(Debug)]
enum FragmentsInner<'a> {
    Flat { plan: &'a TransferPlan, next: usize },
    Patterns(compressed::Expand<'a>),
}

impl Iterator for Fragments<'_> {
    type Item = (u64, u64, u64);

    fn next(&mut self) -> Option<Self::Item> {
        let next = match &mut self.inner {
            FragmentsInner::Flat { plan, next } => {
                let k = *next;
                let f = (k < plan.len.len()).then(|| (plan.src[k], plan.dst[k], plan.len[k]));
                *next += 1;
                f
            }
            FragmentsInner::Patterns(expand) => expand.next(),
        };
        if next.is_some() {
            self.remaining = self.remaining.saturating_sub(1);
        }
        next
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.remaining, Some(self.remaining))
    }
}

impl ExactSizeIterator for Fragments<'_> {}

/// Plans one piece of a request from `me` (the sender) to `peer`: describes both sides with
/// the default describer, asks `planner.pair_compressed` (then `planner.pair` when it has no
/// compressed plan), then validates ([`validate_compressed`] or [`validate`]) and coalesces
/// the result: [`pair_piece`] then [`Planned::validate`].
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
    Ok(pair_piece(planner, me, peer, request)?.validate()?)
}

/// What a planner answered for one piece, not yet validated, with the rows both sides
/// described: the first half of [`plan_transfer`], for a host that times the two halves.
#[derive(Debug)]
pub struct Planned {
    plan: PlanForm,
    my_rows: Vec<LayerGroupRows>,
    peer_rows: Vec<LayerGroupRows>,
}

#[derive(Debug)]
enum PlanForm {
    Flat(TransferPlan),
    Compressed(kvferry_planner_abi::CompressedPlan),
}

impl Planned {
    /// Validates and coalesces the plan (see [`validate`] and [`validate_compressed`]).
    ///
    /// # Errors
    ///
    /// The first broken rule.
    pub fn validate(self) -> Result<ValidatedPlan, PlanRejected> {
        match self.plan {
            PlanForm::Flat(plan) => validate(plan, &self.my_rows, &self.peer_rows),
            PlanForm::Compressed(plan) => validate_compressed(plan, &self.my_rows, &self.peer_rows),
        }
    }
}

/// Describes both sides and asks the planner for one piece (compressed first, then flat),
/// without validating: see [`plan_transfer`].
///
/// # Errors
///
/// A describer refusal on either side, or a planner error.
pub fn pair_piece(
    planner: &dyn TransferPlanner,
    me: RequestSide<'_>,
    peer: RequestSide<'_>,
    request: &PairRequest,
) -> Result<Planned, PlanFailure> {
    let my_rows = me.rows().map_err(PlanFailure::DescribeLocal)?;
    let peer_rows = peer.rows().map_err(PlanFailure::DescribePeer)?;
    let compressed = planner
        .pair_compressed(me.info, peer.info, &my_rows, &peer_rows, request)
        .map_err(PlanFailure::Planner)?;
    let plan = match compressed {
        Some(plan) => PlanForm::Compressed(plan),
        None => PlanForm::Flat(
            planner
                .pair(me.info, peer.info, &my_rows, &peer_rows, request)
                .map_err(PlanFailure::Planner)?,
        ),
    };
    Ok(Planned {
        plan,
        my_rows,
        peer_rows,
    })
}

/// Checks `plan` against the rows of both sides (see the module's rules) and coalesces it.
///
/// # Errors
///
/// The first broken rule: array lengths; then, fragment by fragment in plan order, zero
/// length, overflow, source outside `my_rows`, destination outside `peer_rows`; then
/// overlapping destinations (the pair with the lowest destination address).
pub fn validate(
    plan: TransferPlan,
    my_rows: &[LayerGroupRows],
    peer_rows: &[LayerGroupRows],
) -> Result<ValidatedPlan, PlanRejected> {
    let (src, dst, len) = (&plan.src[..], &plan.dst[..], &plan.len[..]);
    if src.len() != dst.len() || dst.len() != len.len() {
        return Err(PlanRejected::LengthMismatch {
            src: src.len(),
            dst: dst.len(),
            len: len.len(),
        });
    }
    if u32::try_from(len.len()).is_err() {
        return Err(PlanRejected::TooManyFragments {
            fragments: len.len(),
        });
    }
    let mine = Extents::of(my_rows);
    let theirs = Extents::of(peer_rows);
    // Planners emit a row's fragments together, so the row that held the previous fragment
    // almost always holds the next: `find_row` tries it first.
    let (mut src_row, mut row_hint) = (0, 0);
    // The destination row each fragment starts in, for the overlap check.
    let mut dst_row: Vec<u32> = Vec::with_capacity(len.len());
    for k in 0..len.len() {
        let n = len[k];
        if n == 0 {
            return Err(PlanRejected::ZeroLength { fragment: k });
        }
        for (end, address) in [(End::Source, src[k]), (End::Destination, dst[k])] {
            if address.checked_add(n).is_none() {
                return Err(PlanRejected::Overflow {
                    fragment: k,
                    end,
                    address,
                    len: n,
                });
            }
        }
        let (s, d) = (src[k], dst[k]);
        let found = match mine.find_row(s, n, src_row) {
            Some(row) => {
                src_row = row;
                theirs.find_row(d, n, row_hint).ok_or((End::Destination, d))
            }
            None => Err((End::Source, s)),
        };
        match found {
            Ok(row) => row_hint = row,
            Err((end, address)) => {
                return Err(PlanRejected::OutsideRows {
                    fragment: k,
                    end,
                    address,
                    len: n,
                });
            }
        }
        dst_row.push(row_hint);
    }
    check_overlap(dst, len, &dst_row, theirs.starts.len())?;
    Ok(coalesce(plan))
}

/// The bytes one side holds for a request.
struct Extents {
    /// Sorted, merged `[start, end)` intervals: the rows' union.
    merged: Vec<(u64, u64)>,
    /// The distinct row start addresses, ascending. Row `i` in the sense of
    /// [`Extents::find_row`] is `[starts[i], starts[i + 1])`: a partition of the rows' span
    /// into address order, which is all the overlap check needs.
    starts: Vec<u64>,
    /// For each entry of `starts`, the merged interval its row belongs to.
    interval_of: Vec<u32>,
}

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
        // Indexed by u32: past u32::MAX rows (tens of gigabytes of row addresses) the rest
        // are dropped, so fragments in them are refused as outside the rows, never written.
        spans.truncate(u32::MAX as usize);
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(spans.len());
        let mut starts: Vec<u64> = Vec::with_capacity(spans.len());
        let mut interval_of: Vec<u32> = Vec::with_capacity(spans.len());
        for (a, b) in spans {
            match merged.last_mut() {
                // Overlapping (two views of one pool) or byte-adjacent rows join.
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => merged.push((a, b)),
            }
            if starts.last() != Some(&a) {
                starts.push(a);
                interval_of.push((merged.len() - 1) as u32);
            }
        }
        Extents {
            merged,
            starts,
            interval_of,
        }
    }

    /// The row `[address, address + len)` starts in, when a merged interval holds it all,
    /// trying row `hint` first. The interval holding an address can only be that of the last
    /// row starting at or before it: a later interval begins at a later row start.
    fn find_row(&self, address: u64, len: u64, hint: u32) -> Option<u32> {
        let starts_at = |i: usize| {
            self.starts.get(i).is_some_and(|&a| a <= address)
                && self.starts.get(i + 1).is_none_or(|&b| address < b)
        };
        let row = if starts_at(hint as usize) {
            hint as usize
        } else {
            self.starts
                .partition_point(|&a| a <= address)
                .checked_sub(1)?
        };
        let (_, end) = self.merged[self.interval_of[row] as usize];
        (address + len <= end).then_some(row as u32)
    }
}

/// Rule 4, with `row[k]` the destination row fragment `k` starts in (of `rows`, numbered
/// in address order; see [`Extents::starts`]).
///
/// A bucket sort by row: fragments are bucketed by row in linear time, each bucket (a
/// row's fragments, typically already ascending) is sorted on its own only when it is not
/// already in order, and the buckets are scanned in address order with the furthest reach
/// carried from one to the next. That visits the fragments in exactly the order of one
/// global sort by (address, index), in `O(n log b)` for buckets of at most `b` fragments,
/// and reports the same pair: the overlap with the lowest destination address.
fn check_overlap(dst: &[u64], len: &[u64], row: &[u32], rows: usize) -> Result<(), PlanRejected> {
    // Counting sort by row: bucket `r` is `order[start[r]..start[r + 1]]`.
    let mut start = vec![0usize; rows + 1];
    for &r in row {
        start[r as usize + 1] += 1;
    }
    for r in 0..rows {
        start[r + 1] += start[r];
    }
    let mut next = start.clone();
    // Fragment indices as u32 (`validate` refuses larger plans), which halves the memory the
    // buckets touch.
    let mut order = vec![0u32; dst.len()];
    for (k, &r) in row.iter().enumerate() {
        order[next[r as usize]] = k as u32;
        next[r as usize] += 1;
    }
    let key = |&k: &u32| (dst[k as usize], k);
    // The fragment reaching furthest so far, and its end.
    let mut reach: Option<(usize, u64)> = None;
    for bucket in start.windows(2) {
        let bucket = &mut order[bucket[0]..bucket[1]];
        if !bucket.is_sorted_by_key(key) {
            bucket.sort_unstable_by_key(key);
        }
        for k in bucket.iter().map(|&k| k as usize) {
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
    }
    Ok(())
}

/// Merges, in place, each fragment that continues the previous one on both sides.
fn coalesce(mut plan: TransferPlan) -> ValidatedPlan {
    let planned = plan.fragments();
    let TransferPlan { src, dst, len } = &mut plan;
    let mut total = 0;
    // `w` is the number of fragments kept so far; fragment `w - 1` is the one being grown.
    let mut w = 0;
    for r in 0..len.len() {
        let (s, d, n) = (src[r], dst[r], len[r]);
        total += n;
        if w > 0 && src[w - 1] + len[w - 1] == s && dst[w - 1] + len[w - 1] == d {
            len[w - 1] += n;
        } else {
            (src[w], dst[w], len[w]) = (s, d, n);
            w += 1;
        }
    }
    src.truncate(w);
    dst.truncate(w);
    len.truncate(w);
    ValidatedPlan {
        form: Form::Flat(plan),
        fragments: w,
        planned,
        total,
    }
}

/// Why a request's pieces are not a valid split of its prompt.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PiecesError {
    /// The prompt has no tokens.
    #[error("prompt_len is 0")]
    EmptyPrompt,
    /// A block holds no tokens.
    #[error("tokens_per_block is 0")]
    NoBlockSize,
    /// Chunks were given, but none.
    #[error("chunks is empty")]
    NoChunks,
    /// One chunk is wrong.
    #[error("chunk {index} [{start}, {end}): {problem}")]
    BadChunk {
        /// The chunk's index.
        index: usize,
        /// Its first token.
        start: u64,
        /// One past its last token.
        end: u64,
        /// What is wrong: empty, out of order or overlapping, past the prompt, not aligned.
        problem: &'static str,
    },
}

/// The pieces a sender plans for a request of `prompt_len` tokens: the whole prompt, or the
/// given chunks (chunked prefill), the last one `is_last`. Chunks must be non-empty, in
/// order, non-overlapping, inside the prompt and start on a block boundary; each ends on one
/// or at the prompt's end.
///
/// # Errors
///
/// A [`PiecesError`] naming the chunk and what is wrong with it.
pub fn pieces(
    prompt_len: u64,
    tokens_per_block: u32,
    chunks: Option<&[kvferry_planner_abi::TokenRange]>,
) -> Result<Vec<PairRequest>, PiecesError> {
    if prompt_len == 0 {
        return Err(PiecesError::EmptyPrompt);
    }
    if tokens_per_block == 0 {
        return Err(PiecesError::NoBlockSize);
    }
    let Some(chunks) = chunks else {
        return Ok(vec![PairRequest::whole(prompt_len)]);
    };
    if chunks.is_empty() {
        return Err(PiecesError::NoChunks);
    }
    let tpb = u64::from(tokens_per_block);
    let mut previous_end = 0;
    let mut out = Vec::with_capacity(chunks.len());
    for (index, c) in chunks.iter().enumerate() {
        let bad = |problem| PiecesError::BadChunk {
            index,
            start: c.start,
            end: c.end,
            problem,
        };
        if c.start >= c.end {
            return Err(bad("empty"));
        }
        if c.start < previous_end {
            return Err(bad("overlaps or precedes the previous chunk"));
        }
        if c.end > prompt_len {
            return Err(bad("runs past the prompt"));
        }
        if c.start % tpb != 0 || (c.end % tpb != 0 && c.end != prompt_len) {
            return Err(bad("not aligned to blocks"));
        }
        previous_end = c.end;
        out.push(PairRequest {
            token_range: *c,
            prompt_len,
            dst_start_token: kvferry_planner_abi::ffi::ROption::RNone,
            is_last: index + 1 == chunks.len(),
        });
    }
    Ok(out)
}

/// Block-aligned chunks of `chunk` tokens covering `prompt_len` tokens.
pub fn chunk_ranges(prompt_len: u64, chunk: u64) -> Vec<kvferry_planner_abi::TokenRange> {
    (0..prompt_len)
        .step_by(chunk.max(1) as usize)
        .map(|start| kvferry_planner_abi::TokenRange {
            start,
            end: (start + chunk).min(prompt_len),
        })
        .collect()
}

/// `error` and each of its `source()`s, joined by `": "`: what `anyhow` prints for `{:#}`.
///
/// Errors name what failed and keep the cause in `source()`, so their `Display` alone omits
/// it; use this where an error becomes text (a report, a refusal string, a test assertion).
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}
