//! Ordinal pairing (semantics §8.2), the helix stride (§6.2) and plan emission.

use std::collections::HashMap;

use kvferry_planner_abi::{
    CompressedPlan, GroupKind, LayerGroupRows, PageTable, PairRequest, PlanError, PlanPattern,
    RankInfo, ViewId,
};

use crate::link::{Link, ViewPair};
use crate::mapper::Reblock;
use crate::topology::who;

/// Request-level rules that hold before any view is looked at.
pub(crate) fn check_request(
    me: &RankInfo,
    peer: &RankInfo,
    request: &PairRequest,
) -> Result<(), PlanError> {
    let range = request.token_range;
    if range.start > range.end {
        return Err(PlanError::invalid(format!(
            "token range [{}, {}) ends before it starts",
            range.start, range.end
        )));
    }
    // Helix context parallelism lives on the decode side only; the sender is context.
    if me.cp_size > 1 {
        return Err(PlanError::refuse(
            "cp_size",
            me.cp_size,
            peer.cp_size,
            "the sending (context) rank must have cp_size 1: helix pairs a cp=1 context \
             instance with a cp=N decode instance",
        ));
    }
    // T3: block ownership under helix is fixed for the whole prompt.
    let chunked = range.start > 0 || range.end < request.prompt_len;
    if chunked && peer.cp_size > 1 {
        return Err(PlanError::refuse(
            "cp_size",
            me.cp_size,
            peer.cp_size,
            format!(
                "chunked transfer (token range [{}, {}) of a {}-token prompt) is not \
                 supported with context parallelism",
                range.start, range.end, request.prompt_len
            ),
        ));
    }
    Ok(())
}

/// The fragments `me` writes into `peer` for one piece of a request, compressed: one pattern
/// per matched view pair this rank owns (one per sub-block when re-blocking), in page-table
/// order, applied to the view pair's row pairs.
///
/// PAGED rows are paired by ordinal inside the piece's range, STATE rows (the request's one
/// slot) on the last piece only; each pair of rows gets the view pair's fragments, in mapper
/// order. A view excluded on either side has no rows and is skipped.
pub(crate) fn pair(
    me: &RankInfo,
    peer: &RankInfo,
    link: &Link,
    my_rows: &[LayerGroupRows],
    peer_rows: &[LayerGroupRows],
    request: &PairRequest,
) -> Result<CompressedPlan, PlanError> {
    let mine =
        index(&me.page_table, my_rows).map_err(|e| e.context(format!("rows of {}", who(me))))?;
    let theirs = index(&peer.page_table, peer_rows)
        .map_err(|e| e.context(format!("rows of {}", who(peer))))?;

    // §3.6 bounded replay [INFERRED]: a receiver view that is not excluded expects bytes
    // this rank holds but has no view for; writing nothing would leave it stale. The check
    // lives here rather than in `check_peer` because exclusions are per request: only the
    // receiver's rows say which views it rebuilds itself.
    if let Some(u) = link.unserved.iter().find(|u| theirs.contains_key(&u.view)) {
        return Err(PlanError::refuse(
            "excluded_views",
            format!(
                "global layer {} held without a view of these roles",
                u.layer
            ),
            format!("{} not excluded", u.name),
            "bounded replay mismatch: the receiver expects bytes this sender does not keep; \
             the receiver must exclude the view (bounded replay on generation) or the sender \
             keep it",
        ));
    }

    // The ordinals of the piece, `[start / tpb, ceil(end / tpb))`. A start that is not block
    // aligned rounds down: the block holding it is sent whole (the same bytes again, from the
    // same writer). Windowed groups need no case of their own: each block travels with the
    // piece that covers it, and each side's table already masks what it does not hold.
    let tpb = u64::from(me.page_table.tokens_per_block);
    let peer_tpb = peer.page_table.tokens_per_block;
    let range = request.token_range;
    let mut lo = range.start / tpb;
    if let Some(start) = request.dst_start_token.into_option() {
        // A prompt position, so it bounds global (sender) ordinals, helix or not.
        lo = lo.max(start / tpb);
    }
    let hi = range.end.div_ceil(tpb);
    // Helix: receiver local ordinal j of CP rank r holds global (sender) ordinal j × C + r.
    let helix = (peer.cp_size > 1).then(|| (u64::from(peer.cp_size), u64::from(peer.cp_rank)));

    let mut plan = CompressedPlan::new();
    for vp in link.pairs.iter().filter(|vp| vp.owned) {
        let (Some(&(si, src)), Some(&(di, dst))) = (mine.get(&vp.mine), theirs.get(&vp.theirs))
        else {
            continue;
        };
        if vp.class == GroupKind::STATE {
            // [INFERRED §7] The state is a checkpoint at the end of the prompt: it is written
            // once, with the last piece, never from an intermediate chunk.
            if request.is_last && !src.is_empty() && !dst.is_empty() {
                let mut pattern = pattern_of(vp, si, di, src, dst);
                pattern.push_rows(0, 0);
                plan.patterns.push(pattern);
            }
            continue;
        }
        if let Some(rb) = &vp.reblock {
            push_reblocked(
                &mut plan,
                rb,
                (si, src),
                (di, dst),
                request,
                u64::from(peer_tpb),
            );
            continue;
        }
        let mut pattern = pattern_of(vp, si, di, src, dst);
        ordinal_pairs(&mut pattern, src, dst, lo, hi, helix);
        plan.patterns.push(pattern);
    }
    Ok(plan)
}

/// The patterns of a re-blocked view pair (semantics §3.2 rule 4) for one piece: one per
/// sub-block of the larger side's block.
///
/// The unit is a block of the smaller side: the piece covers smaller-side ordinals
/// `[start / small, ceil(end / small))`, starting no earlier than the receiver block that
/// holds `dst_start_token` (that block is sent whole, as with equal block sizes). Smaller
/// ordinal `u` lies in larger ordinal `u / ratio` as sub-block `u % ratio`; a unit moves
/// when both sides hold its rows (holes and windowed fronts skip it).
fn push_reblocked(
    plan: &mut CompressedPlan,
    rb: &Reblock,
    (si, src): (u32, &LayerGroupRows),
    (di, dst): (u32, &LayerGroupRows),
    request: &PairRequest,
    receiver_tpb: u64,
) {
    let small = rb.small_tpb;
    let range = request.token_range;
    let mut lo = range.start / small;
    if let Some(start) = request.dst_start_token.into_option() {
        lo = lo.max(start / receiver_tpb * receiver_tpb / small);
    }
    let hi = range.end.div_ceil(small);
    let r = rb.ratio;
    let mut patterns: Vec<PlanPattern> = rb
        .frags
        .iter()
        .map(|frags| {
            let mut p = PlanPattern::new(si, di);
            for f in frags {
                p.push_fragment(f.src, f.dst, f.len);
            }
            p
        })
        .collect();
    let (larger, smaller) = if rb.mine_larger {
        (src, dst)
    } else {
        (dst, src)
    };
    // Walk the smaller side's ordinals in the piece; find each one's larger row.
    let mut j = larger.ordinals.partition_point(|&o| o < lo / r);
    for k in smaller.ordinals.partition_point(|&o| o < lo)..smaller.len() {
        let u = smaller.ordinals[k];
        if u >= hi {
            break;
        }
        while j < larger.len() && larger.ordinals[j] < u / r {
            j += 1;
        }
        if j < larger.len() && larger.ordinals[j] == u / r {
            let (big, little) = (j as u32, k as u32);
            let pattern = &mut patterns[(u % r) as usize];
            if rb.mine_larger {
                pattern.push_rows(big, little);
            } else {
                pattern.push_rows(little, big);
            }
        }
    }
    plan.patterns
        .extend(patterns.into_iter().filter(|p| p.row_pairs() > 0));
}

/// The rows of one side by view, after checking they describe `pt`.
fn index<'r>(
    pt: &PageTable,
    rows: &'r [LayerGroupRows],
) -> Result<HashMap<ViewId, (u32, &'r LayerGroupRows)>, PlanError> {
    if u32::try_from(rows.len()).is_err() || rows.iter().any(|r| u32::try_from(r.len()).is_err()) {
        return Err(PlanError::invalid(format!(
            "{} row entries: a plan indexes at most 2^32 entries of 2^32 rows",
            rows.len()
        )));
    }
    let mut out = HashMap::with_capacity(rows.len());
    for (position, r) in rows.iter().enumerate() {
        let id = r.view;
        let at = || format!("rows of group {} view {}", id.group, id.view);
        let group = pt
            .groups
            .get(id.group as usize)
            .ok_or_else(|| PlanError::invalid(format!("{}: no such group", at())))?;
        let view = group
            .views
            .get(id.view as usize)
            .ok_or_else(|| PlanError::invalid(format!("{}: no such view", at())))?;
        let pool = pt.pools.get(view.pool as usize).ok_or_else(|| {
            PlanError::invalid(format!("{}: pool {} does not exist", at(), view.pool))
        })?;
        if r.kind != group.kind {
            return Err(PlanError::invalid(format!(
                "{}: kind {} but the group is {}",
                at(),
                r.kind,
                group.kind
            )));
        }
        if r.row_bytes != pool.slot_bytes {
            return Err(PlanError::invalid(format!(
                "{}: {} bytes per row but pool {} has {}-byte slots",
                at(),
                r.row_bytes,
                view.pool,
                pool.slot_bytes
            )));
        }
        if r.ordinals.len() != r.addresses.len() {
            return Err(PlanError::invalid(format!(
                "{}: {} ordinals for {} addresses",
                at(),
                r.ordinals.len(),
                r.addresses.len()
            )));
        }
        if r.ordinals.windows(2).any(|w| w[0] >= w[1]) {
            return Err(PlanError::invalid(format!(
                "{}: ordinals are not strictly ascending",
                at()
            )));
        }
        if group.kind == GroupKind::STATE && r.ordinals.len() > 1 {
            return Err(PlanError::invalid(format!(
                "{}: a STATE view holds at most one row, found {}",
                at(),
                r.ordinals.len()
            )));
        }
        if r.addresses
            .iter()
            .any(|a| a.checked_add(r.row_bytes).is_none())
        {
            return Err(PlanError::invalid(format!(
                "{}: a row runs past 2^64",
                at()
            )));
        }
        if out.insert(id, (position as u32, r)).is_some() {
            return Err(PlanError::invalid(format!("{}: listed twice", at())));
        }
    }
    Ok(out)
}

/// Appends to `pattern` the `(source row, destination row)` indices of the ordinals both
/// sides hold in `[lo, hi)`, in ordinal order. With `helix = (C, r)` the destination's local
/// ordinal `j` stands for the source ordinal `j × C + r`.
fn ordinal_pairs(
    pattern: &mut PlanPattern,
    src: &LayerGroupRows,
    dst: &LayerGroupRows,
    lo: u64,
    hi: u64,
    helix: Option<(u64, u64)>,
) {
    // `index` checked that row indices fit in u32.
    match helix {
        None => {
            let mut j = dst.ordinals.partition_point(|&o| o < lo);
            for k in src.ordinals.partition_point(|&o| o < lo)..src.len() {
                let o = src.ordinals[k];
                if o >= hi {
                    break;
                }
                while j < dst.len() && dst.ordinals[j] < o {
                    j += 1;
                }
                if j < dst.len() && dst.ordinals[j] == o {
                    pattern.push_rows(k as u32, j as u32);
                }
            }
        }
        Some((c, r)) => {
            for (j, &local) in dst.ordinals.iter().enumerate() {
                let Some(o) = local.checked_mul(c).and_then(|g| g.checked_add(r)) else {
                    break;
                };
                if o >= hi {
                    break;
                }
                if o < lo {
                    continue;
                }
                if let Ok(k) = src.ordinals.binary_search(&o) {
                    pattern.push_rows(k as u32, j as u32);
                }
            }
        }
    }
}

/// An empty pattern from entry `si` to entry `di` with the view pair's fragments.
fn pattern_of(
    vp: &ViewPair,
    si: u32,
    di: u32,
    src: &LayerGroupRows,
    dst: &LayerGroupRows,
) -> PlanPattern {
    // Fragments lie inside the slot payload (the gate checked the views against the page
    // tables, `index` the rows against the pools); the host checks it again.
    debug_assert!(vp.frags.iter().all(|f| f.src + f.len <= src.row_bytes));
    debug_assert!(vp.frags.iter().all(|f| f.dst + f.len <= dst.row_bytes));
    let mut pattern = PlanPattern::new(si, di);
    for f in &vp.frags {
        pattern.push_fragment(f.src, f.dst, f.len);
    }
    pattern
}
