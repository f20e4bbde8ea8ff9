//! Compressed plans ([`CompressedPlan`]): validation in time linear in rows plus patterns,
//! and the lazy expansion an executor reads.
//!
//! # Rules
//!
//! For every pattern of a compressed plan:
//!
//! 1. its fragment arrays have one length, its row-pair arrays another;
//! 2. `src_rows` names an entry of this rank's rows, `dst_rows` one of the peer's;
//! 3. every fragment has a length above 0 and lies inside one row on each side
//!    (`offset + len <= row_bytes`);
//! 4. every row pair names rows the entries hold, whose end does not pass 2^64;
//!
//! and, over the whole plan:
//!
//! 5. at most 2^32 - 1 fragments once expanded;
//! 6. no two destination ranges overlap: inside one pattern its fragments' destination
//!    offsets are disjoint (checked once), no pattern names a destination row twice, and the
//!    patterns that land in one destination row have disjoint offsets (checked once per set
//!    of patterns sharing rows).
//!
//! Rule 6 relies on the peer's rows being either the same row (two views of one pool, the
//! same slot) or disjoint. Rows that partly overlap (a pool whose stride is below its slot
//! size, pools that overlap) make the plan go through the flat rules instead, after its
//! expansion: slower, never less strict.
//!
//! Cost: `O(R log R)` in the peer's rows `R` (sorting their addresses), `O(F log F)` per
//! pattern of `F` fragments, `O(P)` per row pair, with `P` the patterns sharing a row.

use std::collections::HashSet;

use kvferry_planner_abi::{CompressedPlan, LayerGroupRows, PlanPattern, TransferPlan};

use crate::{End, Form, PlanRejected, ValidatedPlan, validate};

/// A pattern whose row pairs are resolved to addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Resolved {
    /// The pattern's fragments, coalesced: `(src offset, dst offset, len)`.
    frags: Vec<(u64, u64, u64)>,
    /// `(source row address, destination row address)` per row pair.
    rows: Vec<(u64, u64)>,
}

impl Resolved {
    /// A copy for an outside executor ([`ValidatedPlan::patterns`]).
    pub(crate) fn pattern(&self) -> crate::Pattern {
        crate::Pattern {
            fragments: self.frags.clone(),
            rows: self.rows.clone(),
        }
    }
}

/// Checks a compressed plan against the rows of both sides (see the module's rules) and
/// coalesces it, keeping it compressed.
///
/// # Errors
///
/// The first broken rule, pattern by pattern for rules 1–4; for overlapping destinations,
/// a pair of fragments that overlap (indices into the plan's expansion).
pub fn validate_compressed(
    plan: CompressedPlan,
    my_rows: &[LayerGroupRows],
    peer_rows: &[LayerGroupRows],
) -> Result<ValidatedPlan, PlanRejected> {
    // Flat index of each pattern's first fragment.
    let mut bases = Vec::with_capacity(plan.patterns.len());
    let mut expanded: u64 = 0;
    for (i, p) in plan.patterns.iter().enumerate() {
        check_pattern(i, p, my_rows, peer_rows)?;
        bases.push(expanded);
        expanded = expanded.saturating_add(pattern_fragments(p));
    }
    if expanded > u64::from(u32::MAX) {
        return Err(PlanRejected::TooManyFragments {
            fragments: usize::try_from(expanded).unwrap_or(usize::MAX),
        });
    }
    let Some(row_ids) = destination_rows(peer_rows) else {
        return validate(expand(&plan, my_rows, peer_rows), my_rows, peer_rows);
    };
    check_overlap(&plan, &bases, &row_ids, peer_rows)?;
    Ok(resolve(&plan, my_rows, peer_rows, expanded as usize))
}

fn pattern_fragments(p: &PlanPattern) -> u64 {
    (p.len.len() as u64).saturating_mul(p.src_row.len() as u64)
}

/// Rules 1–4 for pattern `i`.
fn check_pattern(
    i: usize,
    p: &PlanPattern,
    my_rows: &[LayerGroupRows],
    peer_rows: &[LayerGroupRows],
) -> Result<(), PlanRejected> {
    if p.src_offset.len() != p.len.len() || p.dst_offset.len() != p.len.len() {
        return Err(PlanRejected::PatternLengthMismatch {
            pattern: i,
            what: "fragment",
        });
    }
    if p.src_row.len() != p.dst_row.len() {
        return Err(PlanRejected::PatternLengthMismatch {
            pattern: i,
            what: "row-pair",
        });
    }
    let src = entry(i, my_rows, p.src_rows, End::Source)?;
    let dst = entry(i, peer_rows, p.dst_rows, End::Destination)?;
    for (f, (so, dof, len)) in p.iter().enumerate() {
        if len == 0 {
            return Err(PlanRejected::PatternZeroLength {
                pattern: i,
                fragment: f,
            });
        }
        for (end, offset, row_bytes) in [
            (End::Source, so, src.row_bytes),
            (End::Destination, dof, dst.row_bytes),
        ] {
            if offset.checked_add(len).is_none_or(|e| e > row_bytes) {
                return Err(PlanRejected::PatternOutsideRow {
                    pattern: i,
                    fragment: f,
                    end,
                    offset,
                    len,
                    row_bytes,
                });
            }
        }
    }
    for (k, (s, d)) in p.rows().enumerate() {
        for (end, rows, row) in [(End::Source, src, s), (End::Destination, dst, d)] {
            let Some(&address) = rows.addresses.get(row as usize) else {
                return Err(PlanRejected::PatternMissingRow {
                    pattern: i,
                    pair: k,
                    end,
                    row,
                    rows: rows.addresses.len(),
                });
            };
            if address.checked_add(rows.row_bytes).is_none() {
                return Err(PlanRejected::PatternRowOverflow {
                    pattern: i,
                    pair: k,
                    end,
                    address,
                });
            }
        }
    }
    Ok(())
}

/// Entry `at` of one side's rows, for pattern `pattern`.
fn entry(
    pattern: usize,
    rows: &[LayerGroupRows],
    at: u32,
    end: End,
) -> Result<&LayerGroupRows, PlanRejected> {
    rows.get(at as usize).ok_or(PlanRejected::PatternEntry {
        pattern,
        end,
        entry: at,
        entries: rows.len(),
    })
}

/// A number for every row of the peer, per entry: rows at one address with one size share
/// it (two views of one slot), other rows are disjoint. `None` when two rows partly overlap.
fn destination_rows(peer_rows: &[LayerGroupRows]) -> Option<Vec<Vec<u32>>> {
    let total: usize = peer_rows.iter().map(|r| r.addresses.len()).sum();
    if u32::try_from(total).is_err() {
        return None;
    }
    let mut all: Vec<(u64, u64, u32, u32)> = Vec::with_capacity(total);
    for (e, r) in peer_rows.iter().enumerate() {
        for (k, &a) in r.addresses.iter().enumerate() {
            all.push((a, r.row_bytes, e as u32, k as u32));
        }
    }
    all.sort_unstable();
    let mut ids: Vec<Vec<u32>> = peer_rows
        .iter()
        .map(|r| vec![0; r.addresses.len()])
        .collect();
    let mut id = 0u32;
    let mut previous: Option<(u64, u64)> = None;
    for (a, bytes, e, k) in all {
        match previous {
            Some(p) if p == (a, bytes) => {}
            Some((pa, pb)) if a < pa.saturating_add(pb) => return None,
            Some(_) => id += 1,
            None => {}
        }
        ids[e as usize][k as usize] = id;
        previous = Some((a, bytes));
    }
    Some(ids)
}

/// Rule 6 (see the module's docs), on a plan that passed rules 1–5.
fn check_overlap(
    plan: &CompressedPlan,
    bases: &[u64],
    row_ids: &[Vec<u32>],
    peer_rows: &[LayerGroupRows],
) -> Result<(), PlanRejected> {
    let patterns = &plan.patterns[..];
    // The flat index and destination address of fragment `f` of row pair `k` of pattern `p`.
    let locate = |p: usize, k: usize, f: usize| {
        let pat = &patterns[p];
        let row = peer_rows[pat.dst_rows as usize].addresses[pat.dst_row[k] as usize];
        let index = bases[p] + (k * pat.len.len() + f) as u64;
        (index as usize, row + pat.dst_offset[f], pat.len[f])
    };
    let overlap = |(a, b): ((usize, usize, usize), (usize, usize, usize))| {
        let (x, y) = (locate(a.0, a.1, a.2), locate(b.0, b.1, b.2));
        let (first, second) = if x.0 <= y.0 { (x, y) } else { (y, x) };
        PlanRejected::OverlappingDestinations {
            first: first.0,
            first_address: first.1,
            first_len: first.2,
            second: second.0,
            second_address: second.1,
            second_len: second.2,
        }
    };

    // Each pattern's destination footprint inside a row: (offset, end, fragment), ascending.
    let mut footprints: Vec<Vec<(u64, u64, u32)>> = Vec::with_capacity(patterns.len());
    for (p, pat) in patterns.iter().enumerate() {
        let mut fp: Vec<(u64, u64, u32)> = pat
            .dst_offset
            .iter()
            .zip(pat.len.iter())
            .enumerate()
            .map(|(f, (&o, &n))| (o, o + n, f as u32))
            .collect();
        fp.sort_unstable();
        if !pat.dst_row.is_empty() {
            if let Some(w) = fp.windows(2).find(|w| w[1].0 < w[0].1) {
                return Err(overlap(((p, 0, w[0].2 as usize), (p, 0, w[1].2 as usize))));
            }
        }
        footprints.push(fp);
    }

    // Every (destination row, pattern, row pair), bucketed by row.
    let rows = row_ids.iter().map(Vec::len).sum::<usize>();
    let mut count = vec![0usize; rows + 1];
    let live = || {
        patterns
            .iter()
            .enumerate()
            .filter(|(_, pat)| !pat.len.is_empty())
    };
    for (_, pat) in live() {
        let ids = &row_ids[pat.dst_rows as usize];
        for &d in pat.dst_row.iter() {
            count[ids[d as usize] as usize + 1] += 1;
        }
    }
    for r in 0..rows {
        count[r + 1] += count[r];
    }
    let mut next = count.clone();
    let mut order: Vec<(u32, u32)> = vec![(0, 0); count[rows]];
    for (p, pat) in live() {
        let ids = &row_ids[pat.dst_rows as usize];
        for (k, &d) in pat.dst_row.iter().enumerate() {
            let id = ids[d as usize] as usize;
            order[next[id]] = (p as u32, k as u32);
            next[id] += 1;
        }
    }

    // Sets of patterns already found disjoint.
    let mut checked: HashSet<Vec<u32>> = HashSet::new();
    for bucket in count.windows(2) {
        let bucket = &mut order[bucket[0]..bucket[1]];
        if bucket.len() < 2 {
            continue;
        }
        bucket.sort_unstable();
        if let Some(w) = bucket.windows(2).find(|w| w[0].0 == w[1].0) {
            let (p, f) = (w[0].0 as usize, footprints[w[0].0 as usize][0].2 as usize);
            return Err(overlap(((p, w[0].1 as usize, f), (p, w[1].1 as usize, f))));
        }
        let set: Vec<u32> = bucket.iter().map(|&(p, _)| p).collect();
        if checked.contains(&set) {
            continue;
        }
        // Merge the footprints of the patterns sharing this row.
        let mut merged: Vec<(u64, u64, u32, u32)> = bucket
            .iter()
            .enumerate()
            .flat_map(|(b, &(p, _))| {
                footprints[p as usize]
                    .iter()
                    .map(move |&(o, e, f)| (o, e, b as u32, f))
            })
            .collect();
        merged.sort_unstable();
        if let Some(((rb, rf), (b, f), _)) = first_cross_overlap(&merged) {
            let at = |b: u32, f: u32| {
                let (p, k) = bucket[b as usize];
                (p as usize, k as usize, f as usize)
            };
            return Err(overlap((at(rb, rf), at(b, f))));
        }
        checked.insert(set);
    }
    Ok(())
}

/// The validated form: rows resolved to addresses, fragments coalesced inside each pattern,
/// and the count of fragments the lazy expansion yields (merging across rows too).
fn resolve(
    plan: &CompressedPlan,
    my_rows: &[LayerGroupRows],
    peer_rows: &[LayerGroupRows],
    planned: usize,
) -> ValidatedPlan {
    let mut patterns = Vec::with_capacity(plan.patterns.len());
    let (mut fragments, mut total) = (0usize, 0u64);
    // End of the last fragment yielded, on both sides, to count merges across row pairs.
    let mut previous_end: Option<(u64, u64)> = None;
    for pat in plan.patterns.iter() {
        let mut frags: Vec<(u64, u64, u64)> = Vec::with_capacity(pat.len.len());
        for (s, d, n) in pat.iter() {
            match frags.last_mut() {
                Some((ps, pd, pn)) if *ps + *pn == s && *pd + *pn == d => *pn += n,
                _ => frags.push((s, d, n)),
            }
        }
        let (src, dst) = (
            &my_rows[pat.src_rows as usize].addresses,
            &peer_rows[pat.dst_rows as usize].addresses,
        );
        let rows: Vec<(u64, u64)> = pat
            .rows()
            .map(|(s, d)| (src[s as usize], dst[d as usize]))
            .collect();
        if let (Some(&first), Some(&last)) = (frags.first(), frags.last()) {
            let per_row: u64 = frags.iter().map(|f| f.2).sum();
            total += per_row * rows.len() as u64;
            fragments += frags.len() * rows.len();
            for &(rs, rd) in &rows {
                if previous_end == Some((rs + first.0, rd + first.1)) {
                    fragments -= 1;
                }
                previous_end = Some((rs + last.0 + last.2, rd + last.1 + last.2));
            }
        }
        patterns.push(Resolved { frags, rows });
    }
    ValidatedPlan {
        form: Form::Patterns(patterns),
        fragments,
        planned,
        total,
    }
}

/// The flat form of a plan that passed rules 1–5 (so every index resolves).
fn expand(
    plan: &CompressedPlan,
    my_rows: &[LayerGroupRows],
    peer_rows: &[LayerGroupRows],
) -> TransferPlan {
    let mut flat = TransferPlan::new();
    for pat in plan.patterns.iter() {
        let (src, dst) = (
            &my_rows[pat.src_rows as usize].addresses,
            &peer_rows[pat.dst_rows as usize].addresses,
        );
        for (s, d) in pat.rows() {
            let (rs, rd) = (src[s as usize], dst[d as usize]);
            for (so, dof, n) in pat.iter() {
                flat.push(rs + so, rd + dof, n);
            }
        }
    }
    flat
}

/// The fragments of a validated compressed plan, expanded as they are read: pattern by
/// pattern, row pair by row pair, each fragment merged into the previous one when it
/// continues it on both sides.
#[derive(Debug)]
pub(crate) struct Expand<'a> {
    patterns: &'a [Resolved],
    pattern: usize,
    row: usize,
    frag: usize,
    pending: Option<(u64, u64, u64)>,
}

impl<'a> Expand<'a> {
    pub(crate) fn new(patterns: &'a [Resolved]) -> Self {
        Self {
            patterns,
            pattern: 0,
            row: 0,
            frag: 0,
            pending: None,
        }
    }

    /// The next fragment before merging.
    fn raw(&mut self) -> Option<(u64, u64, u64)> {
        loop {
            let pat = self.patterns.get(self.pattern)?;
            if self.row >= pat.rows.len() || pat.frags.is_empty() {
                (self.pattern, self.row, self.frag) = (self.pattern + 1, 0, 0);
                continue;
            }
            let (rs, rd) = pat.rows[self.row];
            let (so, dof, n) = pat.frags[self.frag];
            self.frag += 1;
            if self.frag == pat.frags.len() {
                (self.row, self.frag) = (self.row + 1, 0);
            }
            return Some((rs + so, rd + dof, n));
        }
    }
}

impl Iterator for Expand<'_> {
    type Item = (u64, u64, u64);

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let Some((s, d, n)) = self.raw() else {
                return self.pending.take();
            };
            match &mut self.pending {
                Some((ps, pd, pn)) if *ps + *pn == s && *pd + *pn == d => *pn += n,
                Some(_) => return self.pending.replace((s, d, n)),
                None => self.pending = Some((s, d, n)),
            }
        }
    }
}

/// Two writers whose plans write the same destination bytes ([`overlapping_writers`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriterOverlap {
    /// Index of the first plan (writer).
    pub first: usize,
    /// Index of the second plan.
    pub second: usize,
    /// A destination byte range both write: its start...
    pub address: u64,
    /// ...and length.
    pub len: u64,
}

impl std::fmt::Display for WriterOverlap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "writers {} and {} both write {:#x} +{}",
            self.first, self.second, self.address, self.len
        )
    }
}

/// Whether the plans of several writers into one receiver write disjoint bytes: the first
/// overlap found between two of them, if any (each plan is disjoint in itself, which
/// validation checked).
///
/// A receiver runs this on its own plans of every writer of a request: one planner bug that
/// has two writers fill the same bytes (and leaves others unwritten) passes every writer's
/// own checks and matches every byte count.
///
/// Compressed plans are compared row by row, once per set of patterns that share a
/// destination row; flat ones by sorting every destination range.
pub fn overlapping_writers(plans: &[&ValidatedPlan]) -> Option<WriterOverlap> {
    let compressed: Option<Vec<&[Resolved]>> = plans
        .iter()
        .map(|p| match &p.form {
            Form::Patterns(patterns) => Some(&patterns[..]),
            Form::Flat(_) => None,
        })
        .collect();
    match compressed {
        Some(patterns) => overlapping_patterns(&patterns),
        None => overlapping_ranges(plans),
    }
}

fn overlapping_patterns(plans: &[&[Resolved]]) -> Option<WriterOverlap> {
    // Destination row address -> (writer, pattern) landing there.
    let mut rows: std::collections::HashMap<u64, Vec<(u32, u32)>> = Default::default();
    for (w, patterns) in plans.iter().enumerate() {
        for (p, pat) in patterns.iter().enumerate() {
            if pat.frags.is_empty() {
                continue;
            }
            for &(_, d) in &pat.rows {
                rows.entry(d).or_default().push((w as u32, p as u32));
            }
        }
    }
    let mut checked: HashSet<Vec<(u32, u32)>> = HashSet::new();
    for (&row, landing) in rows.iter_mut() {
        landing.sort_unstable();
        landing.dedup();
        if landing.first().map(|f| f.0) == landing.last().map(|l| l.0) {
            continue;
        }
        if !checked.insert(landing.clone()) {
            continue;
        }
        let mut spans: Vec<(u64, u64, u32, u32)> = landing
            .iter()
            .flat_map(|&(w, p)| {
                plans[w as usize][p as usize]
                    .frags
                    .iter()
                    .map(move |&(_, o, n)| (o, o + n, w, 0))
            })
            .collect();
        spans.sort_unstable();
        if let Some(found) = first_cross_overlap(&spans) {
            return Some(writer_overlap(found, row));
        }
    }
    None
}

fn overlapping_ranges(plans: &[&ValidatedPlan]) -> Option<WriterOverlap> {
    let mut spans: Vec<(u64, u64, u32, u32)> = plans
        .iter()
        .enumerate()
        .flat_map(|(w, p)| p.fragments().map(move |(_, d, n)| (d, d + n, w as u32, 0)))
        .collect();
    spans.sort_unstable();
    first_cross_overlap(&spans).map(|found| writer_overlap(found, 0))
}

/// The overlap of [`first_cross_overlap`] between two writers' spans, at `base` + its start.
fn writer_overlap(((a, _), (b, _), (start, len)): Overlap, base: u64) -> WriterOverlap {
    WriterOverlap {
        first: a.min(b) as usize,
        second: a.max(b) as usize,
        address: base + start,
        len,
    }
}

/// Two `(group, tag)`s whose spans overlap, and where and for how long.
type Overlap = ((u32, u32), (u32, u32), (u64, u64));

/// The first overlap between spans of two different groups, in sorted `(start, end, group,
/// tag)` spans whose spans inside one group are disjoint: the furthest-reaching span so far
/// and the one starting before its end. When the furthest-reaching span belongs to the
/// current span's group, no earlier span can reach into the current one.
fn first_cross_overlap(spans: &[(u64, u64, u32, u32)]) -> Option<Overlap> {
    let mut reach: Option<(u64, u32, u32)> = None;
    for &(start, end, group, tag) in spans {
        if let Some((r_end, r_group, r_tag)) = reach {
            if start < r_end && r_group != group {
                return Some((
                    (r_group, r_tag),
                    (group, tag),
                    (start, end.min(r_end) - start),
                ));
            }
        }
        if reach.is_none_or(|(r_end, _, _)| end > r_end) {
            reach = Some((end, group, tag));
        }
    }
    None
}
