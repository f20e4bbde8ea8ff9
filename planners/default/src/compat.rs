//! The peer check (semantics §3), which builds the [`Link`] to a peer: the matched view
//! pairs with their mappers and ownership, from which every plan to that peer is made.
//!
//! `check_peer` runs in two settings: a decode rank vetting the prefill instance's rank
//! 0 (the only prefill rank it knows), and a prefill rank vetting each decode rank that
//! registers with it. So only what is rank-invariant (sizes, layouts, shard counts) or what
//! the two ranks actually exchange (their common layers) is compared, and both matching
//! directions are vetted, so whichever side runs the check sees the same verdict.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fmt::Display;

use kvferry_planner_abi::{GroupKind, LayoutKind, PageTable, PlanError, RankInfo};

use crate::link::{Link, Unserved, ViewPair};
use crate::mapper::{self, shard_ratio};
use crate::matching::match_views;
use crate::side::Side;
use crate::topology;
use crate::view::{Roles, View, views};

/// Vets `peer` for `me` (§3) and builds the link a sender plans from.
pub(crate) fn check_peer(me: &RankInfo, peer: &RankInfo) -> Result<Link, PlanError> {
    topology::check_rank(me)?;
    topology::check_rank(peer)?;
    check_topology(me, peer)?;

    let mine = views(&me.page_table)
        .map_err(|e| e.context(format!("page table of {}", topology::who(me))))?;
    let theirs = views(&peer.page_table)
        .map_err(|e| e.context(format!("page table of {}", topology::who(peer))))?;

    let forward = match_views(&mine, &peer.page_table, &theirs, Side::Local)?;
    let backward = match_views(&theirs, &me.page_table, &mine, Side::Peer)?;
    let tpb = (
        me.page_table.tokens_per_block,
        peer.page_table.tokens_per_block,
    );
    for &(j, i) in &backward {
        gate_pair(&theirs[j], &mine[i], (tpb.1, tpb.0), Side::Peer)?;
    }
    let mut pairs = Vec::with_capacity(forward.len());
    // (view index, global layer) that some view pair carries, on each side.
    let mut by_mine = Carried::new();
    let mut by_theirs = Carried::new();
    for &(i, j) in &forward {
        let (v, w) = (&mine[i], &theirs[j]);
        gate_pair(v, w, tpb, Side::Local)?;
        let mapped = mapper::build(v, w, tpb)?;
        by_mine.extend(mapped.layers.iter().map(|&l| (i, l)));
        by_theirs.extend(mapped.layers.iter().map(|&l| (j, l)));
        pairs.push(ViewPair {
            mine: v.id,
            theirs: w.id,
            class: v.class,
            owned: mapper::owns(v.layout(), w.layout(), peer.dp_rank),
            replicas: (v.layout().num_replicas, w.layout().num_replicas),
            frags: mapped.frags,
            reblock: mapped.reblock,
        });
    }

    check_paged_coverage(&mine, &theirs, &by_mine)?;
    check_state_coverage(&mine, &theirs, &by_mine, Side::Local)?;
    check_state_coverage(&theirs, &mine, &by_theirs, Side::Peer)?;
    Ok(Link {
        pairs,
        unserved: unserved(&me.page_table, &theirs, &by_theirs),
    })
}

/// `(index of a view, global layer)` pairs that matched view pairs carry.
type Carried = HashSet<(usize, u32)>;

/// Topology rules (§3.1) and the token geometry every PAGED pair shares (§3.2 rule 4).
fn check_topology(me: &RankInfo, peer: &RankInfo) -> Result<(), PlanError> {
    // T1: helix pairs a cp = 1 prefill instance with a cp = N decode instance.
    if me.cp_size > 1 && peer.cp_size > 1 {
        return Err(PlanError::refuse(
            "cp_size",
            me.cp_size,
            peer.cp_size,
            "helix pairs a cp=1 prefill instance with a cp=N decode instance; both sides \
             run context parallelism",
        ));
    }
    let (ours, theirs) = (
        me.page_table.tokens_per_block,
        peer.page_table.tokens_per_block,
    );
    if ours != theirs {
        // T2.
        if me.cp_size > 1 || peer.cp_size > 1 {
            return Err(PlanError::refuse(
                "tokens_per_block",
                ours,
                theirs,
                "helix block-interleaved transfer needs equal tokens_per_block: block \
                 boundaries must coincide for [cp_rank::cp_size] block ownership",
            ));
        }
        // §3.2 rule 4: HND views may re-block when one size is a multiple of the other; a
        // block of the larger side then spans `ratio` blocks of the smaller one, paired
        // token by token (`mapper::Reblock`). NHD and REPLICATED views address bytes inside
        // a block by token and are refused, as is a pair of sizes that do not divide.
        let paged = |pt: &PageTable| pt.groups.iter().any(|g| g.kind == GroupKind::PAGED);
        if paged(&me.page_table) && paged(&peer.page_table) {
            let (hi, lo) = (ours.max(theirs), ours.min(theirs));
            if hi % lo != 0 {
                return Err(PlanError::refuse(
                    "tokens_per_block",
                    ours,
                    theirs,
                    format!(
                        "re-blocking needs one block size to be a multiple of the other \
                         ({hi} is not a multiple of {lo}), so that block boundaries align"
                    ),
                ));
            }
            let token_addressed = |pt: &PageTable| {
                pt.groups
                    .iter()
                    .filter(|g| g.kind == GroupKind::PAGED)
                    .flat_map(|g| g.views.iter())
                    .map(|v| v.layout.kind)
                    .find(|&k| k != LayoutKind::HND)
            };
            if let Some(kind) =
                token_addressed(&me.page_table).or_else(|| token_addressed(&peer.page_table))
            {
                return Err(PlanError::refuse(
                    "tokens_per_block",
                    ours,
                    theirs,
                    format!(
                        "different block sizes are re-blocked for HND views only; a {kind} \
                         view addresses bytes inside a block by token, so its blocks must \
                         hold the same tokens on both sides"
                    ),
                ));
            }
        }
    }
    // TP overlap (§5.1) steps through the finer side in whole multiples of the coarser.
    let (a, b) = (me.tp_per_dp(), peer.tp_per_dp());
    if shard_ratio(a, b).is_none() {
        return Err(PlanError::refuse(
            "tp_size",
            format!("{a} per DP group"),
            format!("{b} per DP group"),
            "the TP widths of one DP group must divide each other",
        ));
    }
    // T4: total layer counts may differ (MTP / speculative layers on one side); only the
    // global layers both sides hold are matched, so there is nothing to refuse.
    Ok(())
}

/// The page-table layout gate (§3.3, with §3.2 and §3.4 in G4 terms) for one matched pair.
/// `side` says whose view `mine` is; `tpb` is `(mine's, theirs')` tokens per block.
fn gate_pair(
    mine: &View<'_>,
    theirs: &View<'_>,
    tpb: (u32, u32),
    side: Side,
) -> Result<(), PlanError> {
    let (a, b) = (mine.layout(), theirs.layout());
    let at = side.between(&mine.name(), &theirs.name());
    let refuse = |field: &str, m: &dyn Display, t: &dyn Display, why: &str| {
        side.refuse(field, m, t, format!("{why} ({at})"))
    };

    // 1. Mapper kinds (also refused by the matching itself).
    if a.kind != b.kind {
        return Err(refuse(
            "layout.kind",
            &a.kind,
            &b.kind,
            "mapper kinds differ",
        ));
    }
    // 2. Element type.
    if a.dtype != b.dtype {
        return Err(refuse(
            "layout.dtype",
            &a.dtype,
            &b.dtype,
            "element types differ (e.g. FP8 against BF16 KV cache)",
        ));
    }
    if a.elem_bits != b.elem_bits {
        return Err(refuse(
            "layout.elem_bits",
            &a.elem_bits,
            &b.elem_bits,
            "element widths differ",
        ));
    }
    // 3. Token-axis class (the matching never pairs across classes; kept as a guard).
    if mine.class != theirs.class {
        return Err(refuse(
            "group.kind",
            &mine.class,
            &theirs.class,
            "a PAGED view cannot pair with a STATE view",
        ));
    }
    if a.kind == LayoutKind::NHD && mine.class == GroupKind::STATE {
        return Err(refuse(
            "layout.kind",
            &a.kind,
            &b.kind,
            "an NHD view is token-major and needs a token axis; a STATE group has none",
        ));
    }
    // 4. Divisible shard counts.
    let (ns, np) = (a.num_shards, b.num_shards);
    if shard_ratio(ns, np).is_none() {
        return Err(refuse(
            "layout.num_shards",
            &ns,
            &np,
            "shard counts must divide each other",
        ));
    }
    // 5. The TP-aggregated size of the role is topology-invariant (per token when the
    //    block sizes differ: a PAGED region holds one block).
    let (ra, rb) = (mine.region(), theirs.region());
    let reblocking = mine.class == GroupKind::PAGED && tpb.0 != tpb.1;
    let (ta, tb) = if reblocking {
        (u128::from(tpb.0), u128::from(tpb.1))
    } else {
        (1, 1)
    };
    if u128::from(ra) * u128::from(ns) * tb != u128::from(rb) * u128::from(np) * ta {
        let per = |r: u64, n: u32, t: u128| {
            if reblocking {
                format!("{r} × {n} for {t} tokens")
            } else {
                format!("{r} × {n}")
            }
        };
        return Err(refuse(
            "bytes_per_layer × num_shards",
            &per(ra, ns, ta),
            &per(rb, np, tb),
            "aggregated region sizes differ: the shape or dtype differs, or a replicated \
             role is declared as sharded",
        ));
    }
    if a.kind == LayoutKind::REPLICATED && ra != rb {
        return Err(refuse(
            "bytes_per_layer",
            &ra,
            &rb,
            "a replicated view is copied whole, so both sides must hold the same bytes per \
             layer",
        ));
    }
    // 7. Shard units: declared alike, and whole multiples in every region.
    let unit = a.shard_unit_bytes;
    if reblocking {
        // One head's `[token][dim]` block scales with the block size; locating each head's
        // token run needs it declared on both sides.
        let ub = b.shard_unit_bytes;
        if unit == 0 || ub == 0 || u128::from(unit) * tb != u128::from(ub) * ta {
            return Err(refuse(
                "layout.shard_unit_bytes",
                &format!("{unit} for {} tokens", tpb.0),
                &format!("{ub} for {} tokens", tpb.1),
                "re-blocking an HND view needs one head's block (shard_unit_bytes) declared \
                 on both sides and equal per token",
            ));
        }
        if ra % unit != 0 || rb % ub != 0 {
            return Err(refuse(
                "layout.shard_unit_bytes",
                &format!("{unit} in a {ra}-byte layer"),
                &format!("{ub} in a {rb}-byte layer"),
                "a layer region is not a whole number of shard units",
            ));
        }
        let (bm, bt) = (mine.buffers(), theirs.buffers());
        let whole = |v: &View<'_>, u: u64| {
            let n = u64::from(v.buffers());
            v.region() % n == 0
                && v.view.entries.iter().all(|e| e.size == v.region() / n)
                && (v.region() / n) % u == 0
        };
        if bm != bt || !whole(mine, unit) || !whole(theirs, ub) {
            return Err(refuse(
                "buffers_per_layer",
                &format!("{bm} buffers of {ra} bytes, heads of {unit}"),
                &format!("{bt} buffers of {rb} bytes, heads of {ub}"),
                "re-blocking works head by head in each buffer: the buffer counts must be \
                 equal and every buffer a whole number of heads",
            ));
        }
    } else if unit != b.shard_unit_bytes {
        return Err(refuse(
            "layout.shard_unit_bytes",
            &unit,
            &b.shard_unit_bytes,
            "shard units differ (head dimension, tokens per block or element size differ)",
        ));
    }
    if !reblocking && unit > 0 && (ra % unit != 0 || rb % unit != 0) {
        return Err(refuse(
            "layout.shard_unit_bytes",
            &format!("{unit} in a {ra}-byte layer"),
            &format!("{unit} in a {rb}-byte layer"),
            "a layer region is not a whole number of shard units",
        ));
    }
    if !reblocking && ns != np && (a.kind == LayoutKind::HND || a.kind == LayoutKind::NHD) {
        // 6. Re-splitting needs byte-aligned shard units on both sides.
        if unit == 0 {
            return Err(refuse(
                "layout.shard_unit_bytes",
                &unit,
                &b.shard_unit_bytes,
                "re-splitting across different shard counts needs a byte-aligned \
                 shard_unit_bytes on both sides (sub-byte head slicing is not byte-aligned)",
            ));
        }
        gate_resplit(mine, theirs, tpb.0, side, &at)?;
    }
    // 8. Sections.
    if a.kind == LayoutKind::SECTIONED {
        let (sa, sb) = (&a.section_bytes, &b.section_bytes);
        if sa.is_empty() || sb.is_empty() || sa.len() != sb.len() {
            return Err(refuse(
                "layout.section_bytes",
                &format!("{} sections", sa.len()),
                &format!("{} sections", sb.len()),
                "a SECTIONED view needs the same, non-zero number of sections on both sides",
            ));
        }
        for (k, (&x, &y)) in sa.iter().zip(sb.iter()).enumerate() {
            if u128::from(x) * u128::from(ns) != u128::from(y) * u128::from(np) {
                return Err(refuse(
                    &format!("layout.section_bytes[{k}] × num_shards"),
                    &format!("{x} × {ns}"),
                    &format!("{y} × {np}"),
                    "aggregated section sizes differ",
                ));
            }
        }
    }
    Ok(())
}

/// The buffer geometry an HND / NHD re-split relies on.
fn gate_resplit(
    mine: &View<'_>,
    theirs: &View<'_>,
    tpb: u32,
    side: Side,
    at: &str,
) -> Result<(), PlanError> {
    let (bm, bt) = (mine.buffers(), theirs.buffers());
    if bm != bt {
        return Err(side.refuse(
            "buffers_per_layer",
            bm,
            bt,
            format!("a head re-split works buffer by buffer; the buffer counts differ ({at})"),
        ));
    }
    let kind = mine.layout().kind;
    let unit = mine.layout().shard_unit_bytes;
    let slice = |v: &View<'_>| -> Option<u64> {
        let buffers = u64::from(v.buffers());
        let buffer = v.region() / buffers;
        // Buffers are split at equal strides, so every entry must be one buffer (a STATE
        // HND region is one buffer whatever its entries).
        let equal = buffers == 1 || v.view.entries.iter().all(|e| e.size == buffer);
        if !equal || v.region() % buffers != 0 {
            return None;
        }
        if kind == LayoutKind::NHD {
            let tokens = u64::from(tpb);
            (buffer % tokens == 0).then(|| buffer / tokens)
        } else {
            Some(buffer)
        }
    };
    let what = if kind == LayoutKind::NHD {
        "token slice of a buffer"
    } else {
        "buffer"
    };
    let fits = |v: &View<'_>| slice(v).is_some_and(|s| s % unit == 0);
    if !fits(mine) || !fits(theirs) {
        let text = |v: &View<'_>| {
            let sizes: BTreeSet<u64> = v.view.entries.iter().map(|e| e.size).collect();
            format!(
                "{} bytes per layer in {} buffers, entry sizes {sizes:?}",
                v.region(),
                v.buffers()
            )
        };
        return Err(side.refuse(
            "entries.size",
            text(mine),
            text(theirs),
            format!(
                "a head re-split needs equal buffers whose {what} is a whole number of \
                 {unit}-byte shard units ({at})"
            ),
        ));
    }
    Ok(())
}

/// Every global layer both sides cache in PAGED views must be carried by some view pair:
/// otherwise the receiver's bytes for it stay unwritten. This catches a role mismatch such
/// as an MLA latent cache (`{key}`) against separate K and V heads (`{key,value}`), while a
/// one-sided side cache on a layer that another pair carries stays legal.
fn check_paged_coverage(
    mine: &[View<'_>],
    theirs: &[View<'_>],
    carried: &Carried,
) -> Result<(), PlanError> {
    let by_layer = |vs: &[View<'_>]| -> BTreeMap<u32, BTreeSet<String>> {
        let mut out: BTreeMap<u32, BTreeSet<String>> = BTreeMap::new();
        for v in vs.iter().filter(|v| v.class == GroupKind::PAGED) {
            for l in v.globals() {
                out.entry(l)
                    .or_default()
                    .insert(Roles(&v.roles()).to_string());
            }
        }
        out
    };
    let (ours, peers) = (by_layer(mine), by_layer(theirs));
    let covered: HashSet<u32> = carried
        .iter()
        .filter(|&&(i, _)| mine[i].class == GroupKind::PAGED)
        .map(|&(_, l)| l)
        .collect();
    for (layer, roles) in &ours {
        let Some(peer_roles) = peers.get(layer) else {
            continue;
        };
        if !covered.contains(layer) {
            let join = |s: &BTreeSet<String>| s.iter().cloned().collect::<Vec<_>>().join(" ");
            return Err(PlanError::refuse(
                "roles",
                join(roles),
                join(peer_roles),
                format!(
                    "global layer {layer} is cached on both sides but no view pair carries \
                     it: no view of the other side has the same roles (e.g. an MLA latent \
                     against separate K and V heads)"
                ),
            ));
        }
    }
    Ok(())
}

/// Recurrent state (§3.4 rule 4, generalised): a STATE view of `mine` holding a layer that
/// the other side also holds in STATE views must be matched for that layer, or the state
/// slot on the receiving side would be left incomplete.
fn check_state_coverage(
    mine: &[View<'_>],
    theirs: &[View<'_>],
    carried: &Carried,
    side: Side,
) -> Result<(), PlanError> {
    let mut peer_state: BTreeMap<u32, Vec<&View<'_>>> = BTreeMap::new();
    for w in theirs.iter().filter(|w| w.class == GroupKind::STATE) {
        for l in w.globals() {
            peer_state.entry(l).or_default().push(w);
        }
    }
    for (i, v) in mine.iter().enumerate() {
        if v.class != GroupKind::STATE {
            continue;
        }
        for l in v.globals() {
            let Some(others) = peer_state.get(&l) else {
                continue;
            };
            if !carried.contains(&(i, l)) {
                let names: Vec<String> = others.iter().map(|w| w.name()).collect();
                return Err(side.refuse(
                    "roles",
                    v.name(),
                    names.join("; "),
                    format!(
                        "recurrent state of global layer {l} has a view on one side only (or \
                         with different roles): the state would arrive incomplete"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Peer views whose layers this rank holds, in a group of the same class, but that no view
/// pair of this rank serves (§3.6, bounded replay): sending to such a view is refused unless
/// the receiver lists it in its excluded views for the request.
fn unserved(my_table: &PageTable, theirs: &[View<'_>], served: &Carried) -> Vec<Unserved> {
    let held: HashSet<(GroupKind, u32)> = my_table
        .groups
        .iter()
        .flat_map(|g| g.layers.iter().map(move |l| (g.kind, l.global)))
        .collect();
    theirs
        .iter()
        .enumerate()
        .filter_map(|(j, w)| {
            w.globals()
                .find(|&l| held.contains(&(w.class, l)) && !served.contains(&(j, l)))
                .map(|layer| Unserved {
                    view: w.id,
                    name: w.name(),
                    layer,
                })
        })
        .collect()
}
