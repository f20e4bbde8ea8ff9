//! Shard pairing and ownership (semantics §5.2) and the mappers that turn one matched view
//! pair into per-row fragments (§5.3, §7).
//!
//! A mapper's output is a list of `(src offset, dst offset, len)` relative to the two rows'
//! slot starts; the same list applies to every paired row of the view pair.
//!
//! Byte layouts the shard arithmetic relies on:
//! - HND buffer `[head][token][dim]`: a head range is contiguous inside each buffer;
//! - NHD buffer `[token][head][dim]`: a head range is contiguous inside each token, whose
//!   stride is `buffer bytes / tokens_per_block`;
//! - SECTIONED region: concatenated sections, each channel-major, so a shard range of a
//!   section is contiguous;
//! - STATE HND region (SSM state): `[head][...]`, re-split by head as one buffer;
//! - HND re-blocking: a head's `[token][dim]` block is contiguous, so tokens `k × small ..
//!   (k + 1) × small` of a larger block's head are one run, the smaller block's whole head.

use kvferry_planner_abi::{GroupKind, LayoutKind, PlanError, RoleLayout};

use crate::view::View;

/// One copy inside a pair of rows: `len` bytes from `src` (offset in the local row) to
/// `dst` (offset in the peer row).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Frag {
    pub(crate) src: u64,
    pub(crate) dst: u64,
    pub(crate) len: u64,
}

/// `(num_shards, shard_index)` of one side of a view pair.
pub(crate) type Shards = (u32, u32);

/// `max(n) / min(n)` when the two shard counts divide each other.
pub(crate) fn shard_ratio(a: u32, b: u32) -> Option<u32> {
    let (hi, lo) = (a.max(b), a.min(b));
    (lo > 0 && hi % lo == 0).then(|| hi / lo)
}

/// Whether one side's shard contains the other's (the finer shard lies inside the coarser).
pub(crate) fn paired(mine: Shards, theirs: Shards) -> bool {
    let Some(r) = shard_ratio(mine.0, theirs.0) else {
        return false;
    };
    if mine.0 <= theirs.0 {
        theirs.1 / r == mine.1
    } else {
        mine.1 / r == theirs.1
    }
}

/// Whether this rank writes a view pair into a peer rank whose DP rank is `peer_dp_rank`.
///
/// Unpaired shards never write. When this side holds more replicas of a shard than the
/// peer (`ratio` local ranks hold the bytes one peer rank needs), exactly one of them is
/// elected, rotated by the destination's DP rank so replicated traffic spreads out.
pub(crate) fn owns(mine: &RoleLayout, theirs: &RoleLayout, peer_dp_rank: u32) -> bool {
    let shards = |l: &RoleLayout| (l.num_shards, l.shard_index);
    if !paired(shards(mine), shards(theirs)) {
        return false;
    }
    let ratio = (mine.num_replicas / theirs.num_replicas.max(1)).max(1);
    ratio <= 1 || mine.replica_index % ratio == peer_dp_rank % ratio
}

/// Shard arithmetic for one shardable region of `a` local and `b` peer bytes: returns
/// `(src offset, dst offset, len)`, or `None` when the sizes do not fit the shard counts.
///
/// - equal counts: the whole region (`a == b`);
/// - local coarser (`r = n_peer / n_local`): the peer's `b` bytes sit in our region at
///   `(i_peer % r) × b`;
/// - peer coarser: our `a` bytes go to the peer's region at `(i_local % r) × a`.
pub(crate) fn shard_split(a: u64, b: u64, mine: Shards, theirs: Shards) -> Option<(u64, u64, u64)> {
    let r = u64::from(shard_ratio(mine.0, theirs.0)?);
    if mine.0 == theirs.0 {
        (a == b).then_some((0, 0, a))
    } else if mine.0 < theirs.0 {
        (a == b.checked_mul(r)?).then_some((u64::from(theirs.1) % r * b, 0, b))
    } else {
        (b == a.checked_mul(r)?).then_some((0, u64::from(mine.1) % r * a, a))
    }
}

/// What one view pair moves per pair of rows.
#[derive(Debug)]
pub(crate) struct Mapped {
    /// Global layers both views hold, in the local view's physical order.
    pub(crate) layers: Vec<u32>,
    /// Fragments per pair of rows, in mapper order (empty when re-blocking).
    pub(crate) frags: Vec<Frag>,
    /// The re-blocking mapper, when the two sides' blocks hold different token counts.
    pub(crate) reblock: Option<Reblock>,
}

/// An HND view pair whose blocks hold different token counts (semantics §3.2 rule 4): a
/// block of the larger side holds `ratio` consecutive blocks of the smaller side.
///
/// Inside one HND buffer `[head][token][dim]` the tokens of one head are contiguous, so the
/// `k`-th sub-block of a larger block's head row is one contiguous run of the smaller
/// block's head row length. `frags[k]` pairs the larger row's `k`-th sub-block with a whole
/// smaller row: offsets are relative to the local and peer row, as for [`Frag`].
#[derive(Debug)]
pub(crate) struct Reblock {
    /// Larger block size over the smaller (at least 2).
    pub(crate) ratio: u64,
    /// Whether the local side has the larger blocks.
    pub(crate) mine_larger: bool,
    /// Tokens per block on the smaller side.
    pub(crate) small_tpb: u64,
    /// Fragments per sub-block `k < ratio`.
    pub(crate) frags: Vec<Vec<Frag>>,
}

/// Builds the mapper of a matched view pair that passed the peer check's layout gate (in
/// `compat`, which calls this); the checks here only guard that contract.
///
/// | view pair                        | fragments per row                                 |
/// |----------------------------------|---------------------------------------------------|
/// | REPLICATED, or equal shard count | one per run of layers adjacent on both sides      |
/// | SECTIONED                        | one per (layer, section)                          |
/// | HND                              | one per (layer, buffer)                           |
/// | NHD                              | one per (layer, buffer, token)                    |
/// | HND, different `tokens_per_block` | per sub-block: one per (layer, buffer, head)     |
///
/// `tokens_per_block` is `(local, peer)`; different sizes on a PAGED pair take the
/// re-blocking mapper ([`Reblock`], HND only).
pub(crate) fn build(
    mine: &View<'_>,
    theirs: &View<'_>,
    tokens_per_block: (u32, u32),
) -> Result<Mapped, PlanError> {
    // Overlapping layers in our physical order, so layers adjacent on both sides merge.
    let common: Vec<(u32, u64, u64)> = mine
        .ranges
        .iter()
        .filter_map(|r| {
            theirs
                .layer(r.global)
                .map(|t| (r.global, r.offset, t.offset))
        })
        .collect();
    let (a, b) = (mine.region(), theirs.region());
    let (ours, peer) = (mine.shards(), theirs.shards());
    let kind = mine.layout().kind;
    let bad = |what: &str| {
        PlanError::invalid(format!(
            "{what}: {} ({a} bytes per layer, shards {ours:?}) vs peer {} ({b} bytes per \
             layer, shards {peer:?})",
            mine.name(),
            theirs.name()
        ))
    };

    if mine.class == GroupKind::PAGED && tokens_per_block.0 != tokens_per_block.1 {
        if kind != LayoutKind::HND {
            return Err(bad(&format!("re-blocking a {kind} view")));
        }
        let reblock = reblock(mine, theirs, &common, tokens_per_block).ok_or_else(|| {
            bad(&format!(
                "heads do not line up for re-blocking {} against {} tokens per block",
                tokens_per_block.0, tokens_per_block.1
            ))
        })?;
        return Ok(Mapped {
            layers: common.iter().map(|&(l, _, _)| l).collect(),
            frags: Vec::new(),
            reblock: Some(reblock),
        });
    }
    let tokens_per_block = tokens_per_block.0;
    let mut frags = Vec::new();
    if kind == LayoutKind::REPLICATED || ours.0 == peer.0 {
        if a != b {
            return Err(bad("an intact copy needs equal layer regions"));
        }
        for &(_, s, d) in &common {
            match frags.last_mut() {
                Some(Frag { src, dst, len }) if *src + *len == s && *dst + *len == d => {
                    *len += a;
                }
                _ => frags.push(Frag {
                    src: s,
                    dst: d,
                    len: a,
                }),
            }
        }
    } else if kind == LayoutKind::SECTIONED {
        let (sa, sb) = (&mine.layout().section_bytes, &theirs.layout().section_bytes);
        if sa.is_empty() || sa.len() != sb.len() {
            return Err(bad("sections do not line up"));
        }
        let mut splits = Vec::with_capacity(sa.len());
        let (mut at_a, mut at_b) = (0, 0);
        for (&x, &y) in sa.iter().zip(sb.iter()) {
            let (s, d, len) = shard_split(x, y, ours, peer)
                .ok_or_else(|| bad("section sizes do not fit the shard counts"))?;
            splits.push((at_a + s, at_b + d, len));
            at_a += x;
            at_b += y;
        }
        for &(_, s, d) in &common {
            for &(x, y, len) in &splits {
                frags.push(Frag {
                    src: s + x,
                    dst: d + y,
                    len,
                });
            }
        }
    } else if kind == LayoutKind::HND || kind == LayoutKind::NHD {
        let buffers = u64::from(mine.buffers());
        if buffers != u64::from(theirs.buffers()) || a % buffers != 0 || b % buffers != 0 {
            return Err(bad("buffers do not line up"));
        }
        let (buf_a, buf_b) = (a / buffers, b / buffers);
        // The region re-split: HND the whole buffer, NHD each token's slice of it.
        let tokens = if kind == LayoutKind::NHD {
            u64::from(tokens_per_block)
        } else {
            1
        };
        if buf_a % tokens != 0 || buf_b % tokens != 0 {
            return Err(bad("buffers are not a whole number of tokens"));
        }
        let (slice_a, slice_b) = (buf_a / tokens, buf_b / tokens);
        let (x, y, len) = shard_split(slice_a, slice_b, ours, peer)
            .ok_or_else(|| bad("buffer sizes do not fit the shard counts"))?;
        for &(_, s, d) in &common {
            for k in 0..buffers {
                for t in 0..tokens {
                    frags.push(Frag {
                        src: s + k * buf_a + t * slice_a + x,
                        dst: d + k * buf_b + t * slice_b + y,
                        len,
                    });
                }
            }
        }
    } else {
        return Err(bad(&format!("layout kind {kind} has no mapper")));
    }
    frags.retain(|f| f.len > 0);
    Ok(Mapped {
        layers: common.iter().map(|&(l, _, _)| l).collect(),
        frags,
        reblock: None,
    })
}

/// The re-blocking mapper of an HND view pair (see [`Reblock`]): per sub-block, one
/// fragment per (layer, buffer, common head). `None` when the heads do not line up (no
/// shard unit, buffers that are not whole heads, head counts that do not fit the shards).
fn reblock(
    mine: &View<'_>,
    theirs: &View<'_>,
    common: &[(u32, u64, u64)],
    (tpb_a, tpb_b): (u32, u32),
) -> Option<Reblock> {
    let (ua, ub) = (
        mine.layout().shard_unit_bytes,
        theirs.layout().shard_unit_bytes,
    );
    let buffers = u64::from(mine.buffers());
    let (a, b) = (mine.region(), theirs.region());
    if ua == 0 || ub == 0 || buffers != u64::from(theirs.buffers()) {
        return None;
    }
    if a % buffers != 0 || b % buffers != 0 {
        return None;
    }
    let (buf_a, buf_b) = (a / buffers, b / buffers);
    if buf_a % ua != 0 || buf_b % ub != 0 {
        return None;
    }
    // Head counts re-split like bytes: (first local head, first peer head, heads in common).
    let (x, y, n) = shard_split(buf_a / ua, buf_b / ub, mine.shards(), theirs.shards())?;
    let (hi, lo) = (tpb_a.max(tpb_b), tpb_a.min(tpb_b));
    if lo == 0 || hi % lo != 0 {
        return None;
    }
    let ratio = u64::from(hi / lo);
    let mine_larger = tpb_a > tpb_b;
    // One head row of the smaller side is one sub-block of the larger side's head row.
    let (small_row, large_row) = if mine_larger { (ub, ua) } else { (ua, ub) };
    if small_row.checked_mul(ratio)? != large_row {
        return None;
    }
    let frags = (0..ratio)
        .map(|k| {
            let mut out = Vec::with_capacity(common.len() * (buffers * n) as usize);
            for &(_, s, d) in common {
                for buf in 0..buffers {
                    for h in 0..n {
                        let src = s + buf * buf_a + (x + h) * ua;
                        let dst = d + buf * buf_b + (y + h) * ub;
                        out.push(if mine_larger {
                            Frag {
                                src: src + k * ub,
                                dst,
                                len: ub,
                            }
                        } else {
                            Frag {
                                src,
                                dst: dst + k * ua,
                                len: ua,
                            }
                        });
                    }
                }
            }
            out
        })
        .collect();
    Some(Reblock {
        ratio,
        mine_larger,
        small_tpb: u64::from(lo),
        frags,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_split_covers_the_three_cases() {
        // Equal counts: the whole region, sizes must match.
        assert_eq!(shard_split(64, 64, (2, 1), (2, 1)), Some((0, 0, 64)));
        assert_eq!(shard_split(64, 32, (2, 1), (2, 1)), None);
        // Local coarser: pick the peer's part inside our region.
        assert_eq!(shard_split(128, 64, (1, 0), (2, 1)), Some((64, 0, 64)));
        assert_eq!(shard_split(128, 32, (2, 1), (8, 5)), Some((32, 0, 32)));
        assert_eq!(shard_split(100, 64, (1, 0), (2, 1)), None);
        // Peer coarser: place our part inside the peer's region.
        assert_eq!(shard_split(64, 128, (2, 1), (1, 0)), Some((0, 64, 64)));
        assert_eq!(shard_split(32, 128, (8, 6), (2, 1)), Some((0, 64, 32)));
        // Counts that do not divide.
        assert_eq!(shard_split(64, 48, (3, 0), (4, 0)), None);
    }

    #[test]
    fn pairing_follows_the_covering_tree() {
        // §13.20: equal widths pair iff the indices are equal.
        for s in 0..2 {
            for r in 0..2 {
                assert_eq!(paired((2, s), (2, r)), s == r);
            }
        }
        // §13.21: a grid of 2 feeding a grid of 4: receiver g pairs sender g / 2 only.
        for g in 0..4 {
            for s in 0..2 {
                assert_eq!(
                    paired((2, s), (4, g)),
                    s == g / 2,
                    "sender {s} receiver {g}"
                );
                assert_eq!(paired((4, g), (2, s)), s == g / 2, "reverse {g} {s}");
            }
        }
        assert!(!paired((3, 0), (4, 0)));
    }

    fn layout(shards: (u32, u32), replicas: (u32, u32)) -> RoleLayout {
        RoleLayout {
            num_shards: shards.0,
            shard_index: shards.1,
            num_replicas: replicas.0,
            replica_index: replicas.1,
            ..RoleLayout::whole(LayoutKind::HND, "bf16", 16)
        }
    }

    #[test]
    fn one_replica_is_elected_per_destination() {
        // MLA: TP8 context (8 replicas) into an attention-DP decode rank (1 replica):
        // exactly the prefill rank whose replica index matches the DP rank writes.
        let peer = layout((1, 0), (1, 0));
        for dp in 0..8 {
            let owners: Vec<u32> = (0..8)
                .filter(|&t| owns(&layout((1, 0), (8, t)), &peer, dp))
                .collect();
            assert_eq!(owners, vec![dp]);
        }
        // Fewer local replicas than the peer: everybody paired writes.
        assert!(owns(&layout((4, 1), (1, 0)), &layout((8, 3), (2, 1)), 0));
        // Unpaired shards never write.
        assert!(!owns(&layout((4, 1), (1, 0)), &layout((8, 4), (1, 0)), 0));
    }
}
