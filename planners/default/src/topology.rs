//! Which peer ranks a rank exchanges with (semantics §5.1) and whether their shares are
//! uniform (§9.1).

use std::collections::BTreeSet;

use kvferry_planner_abi::{
    GroupKind, LayoutKind, PageTable, PeerTargets, PlanError, RankInfo, ffi::RVec,
};

use crate::link::Link;

/// `instance rank N` with the instance name, for messages.
pub(crate) fn who(ri: &RankInfo) -> String {
    format!("instance {} rank {}", ri.instance_name, ri.instance_rank)
}

/// Structural checks of a rank's topology every computation here relies on.
pub(crate) fn check_rank(ri: &RankInfo) -> Result<(), PlanError> {
    let axes = [
        ("tp", ri.tp_size, ri.tp_rank),
        ("pp", ri.pp_size, ri.pp_rank),
        ("cp", ri.cp_size, ri.cp_rank),
        ("dp", ri.dp_size, ri.dp_rank),
    ];
    for (axis, size, rank) in axes {
        if rank >= size {
            return Err(PlanError::invalid(format!(
                "{}: {axis}_rank {rank} is not below {axis}_size {size}",
                who(ri)
            )));
        }
    }
    if ri.layers_per_pp.len() != ri.pp_size as usize {
        return Err(PlanError::invalid(format!(
            "{}: layers_per_pp has {} entries for pp_size {}",
            who(ri),
            ri.layers_per_pp.len(),
            ri.pp_size
        )));
    }
    if ri.attention_dp && ri.tp_size % ri.dp_size != 0 {
        return Err(PlanError::invalid(format!(
            "{}: attention DP with dp_size {} does not divide tp_size {}",
            who(ri),
            ri.dp_size,
            ri.tp_size
        )));
    }
    Ok(())
}

/// `(overlap, first)`: the peer indices `first .. first + overlap` a rank at `self_rank` of
/// `self_val` overlaps among `peer_val`, offset by `peer_offset` (the peer DP group's TP
/// slice). Widths divide each other (checked with the peer).
pub(crate) fn find_overlap(
    self_val: u32,
    peer_val: u32,
    self_rank: u32,
    peer_offset: u32,
) -> (u32, u32) {
    if self_val <= peer_val {
        let overlap = peer_val / self_val;
        (overlap, self_rank * overlap + peer_offset)
    } else {
        (1, self_rank / (self_val / peer_val) + peer_offset)
    }
}

/// The peer ranks `me` exchanges with for the peer DP group `peer_dp_rank`, and whether
/// their shares are uniform.
pub(crate) fn targets(
    me: &RankInfo,
    peer: &RankInfo,
    peer_dp_rank: u32,
    link: &Link,
) -> Result<PeerTargets, PlanError> {
    let overlap = overlap(me, peer, peer_dp_rank)?;
    let uniform = uniform(me, peer, link, overlap.ranks.len(), overlap.stages);
    Ok(PeerTargets {
        ranks: overlap.ranks,
        uniform,
    })
}

/// The peer ranks one rank overlaps.
#[derive(Debug)]
pub(crate) struct Overlap {
    /// Peer instance ranks, ascending.
    pub(crate) ranks: RVec<u32>,
    /// Peer PP stages among them.
    pub(crate) stages: usize,
}

/// The peer ranks `me` overlaps in the peer DP group `peer_dp_rank` (§5.1).
///
/// PP stages whose layer ranges overlap ours, × the TP ranks of the DP group that overlap
/// ours, × the CP ranks that overlap ours, flattened CP-minor as
/// `pp × (tp_size × cp_size) + tp × cp_size + cp` (tp includes the DP group's offset
/// `peer_dp_rank × tp_per_dp`); ascending. Both ranks passed [`check_rank`].
pub(crate) fn overlap(
    me: &RankInfo,
    peer: &RankInfo,
    peer_dp_rank: u32,
) -> Result<Overlap, PlanError> {
    let groups = peer.tp_size / peer.tp_per_dp();
    if peer_dp_rank >= groups {
        return Err(PlanError::invalid(format!(
            "peer DP rank {peer_dp_rank} is not below the {groups} DP groups of {}",
            who(peer)
        )));
    }
    let mine = me.pp_layer_range();
    let mut stages = Vec::new();
    let mut start = 0u64;
    for (p, &n) in peer.layers_per_pp.iter().enumerate() {
        let end = start + u64::from(n);
        if mine.start < end && mine.end > start {
            stages.push(p as u32);
        }
        start = end;
    }
    let mut ranks = RVec::new();
    if stages.is_empty() {
        return Ok(Overlap { ranks, stages: 0 });
    }
    let peer_tp = peer.tp_per_dp();
    let (tp_n, tp_first) = find_overlap(
        me.tp_per_dp(),
        peer_tp,
        me.tp_rank_in_dp(),
        peer_dp_rank * peer_tp,
    );
    let (cp_n, cp_first) = find_overlap(me.cp_size, peer.cp_size, me.cp_rank, 0);
    for &pp in &stages {
        for tp in tp_first..tp_first + tp_n {
            for cp in cp_first..cp_first + cp_n {
                ranks.push(pp * peer.tp_size * peer.cp_size + tp * peer.cp_size + cp);
            }
        }
    }
    Ok(Overlap {
        ranks,
        stages: stages.len(),
    })
}

/// Whether every writer contributes an equal share of the receiver's bytes (§9.1). Advisory
/// and conservative: any doubt answers `false`.
fn uniform(me: &RankInfo, peer: &RankInfo, link: &Link, writers: usize, stages: usize) -> bool {
    match writers {
        0 => return false,
        1 => return true,
        _ => {}
    }
    // CP: one KV owner, one state sender, the rest empty. PP fan-in: stages may hold
    // different layer counts. Replica election: some writers send nothing.
    if me.cp_size > 1 || peer.cp_size > 1 || stages > 1 {
        return false;
    }
    if link.pairs.iter().any(|p| p.replicas.0 != p.replicas.1) {
        return false;
    }
    [&me.page_table, &peer.page_table]
        .into_iter()
        .all(|pt| equal_blocks(pt, writers as u64))
}

/// No recurrent state, no replicated view (one elected owner writes it), and every PAGED
/// group's block bytes equal and divisible by the writer count.
fn equal_blocks(pt: &PageTable, writers: u64) -> bool {
    let mut sizes = BTreeSet::new();
    for group in pt.groups.iter() {
        if group.kind == GroupKind::STATE {
            return false;
        }
        if group
            .views
            .iter()
            .any(|v| v.layout.kind == LayoutKind::REPLICATED)
        {
            return false;
        }
        // Several views of one pool share its slots: count each pool once.
        let pools: BTreeSet<u32> = group.views.iter().map(|v| v.pool).collect();
        let bytes: u64 = pools
            .iter()
            .filter_map(|&p| pt.pools.get(p as usize))
            .map(|p| p.slot_bytes)
            .sum();
        sizes.insert(bytes);
    }
    sizes.len() <= 1 && sizes.iter().all(|b| b % writers == 0)
}

#[cfg(test)]
mod tests {
    use super::{find_overlap, overlap};
    use crate::testkit::{rank, table};

    #[test]
    fn multi_axis_overlap_is_cp_minor_and_ascending() {
        // §13.11: self pp2 rank 1 (layers [1, 2]), tp2 rank 1, cp2 rank 1; peer pp4
        // [1, 1, 1, 1], tp4, cp4 → pp 1..2, tp 2..3, cp 2..3.
        let mut me = rank("gen", table(&[]));
        (
            me.pp_size, me.pp_rank, me.tp_size, me.tp_rank, me.cp_size, me.cp_rank,
        ) = (2, 1, 2, 1, 2, 1);
        me.layers_per_pp = vec![1, 2].into();
        let mut peer = rank("ctx", table(&[]));
        (peer.pp_size, peer.tp_size, peer.cp_size) = (4, 4, 4);
        peer.layers_per_pp = vec![1, 1, 1, 1].into();
        let o = overlap(&me, &peer, 0).unwrap();
        assert_eq!(o.ranks.as_slice(), &[26, 27, 30, 31, 42, 43, 46, 47]);
        assert_eq!(o.stages, 2);
    }

    #[test]
    fn overlap_steps_through_the_finer_side() {
        assert_eq!(find_overlap(2, 4, 1, 0), (2, 2));
        assert_eq!(find_overlap(4, 2, 3, 0), (1, 1));
        assert_eq!(find_overlap(1, 4, 0, 8), (4, 8));
        assert_eq!(find_overlap(8, 1, 5, 3), (1, 3));
        assert_eq!(find_overlap(4, 4, 2, 0), (1, 2));
    }
}
