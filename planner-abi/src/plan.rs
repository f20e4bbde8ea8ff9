//! What a planner returns: targets and transfer plans.

use abi_stable::StableAbi;
use abi_stable::std_types::RVec;
use serde::{Deserialize, Serialize};

/// The peer ranks one rank exchanges with for one peer DP group.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerTargets {
    /// Peer instance ranks, ascending. On the receiver, `ranks.len()` is the number of writers
    /// it waits for; on the sender, the destinations it serves.
    pub ranks: RVec<u32>,
    /// Whether every writer contributes an equal share (advisory; see semantics §9.1).
    pub uniform: bool,
}

/// The bytes one sender rank writes for one piece of a request, as a structure of arrays:
/// fragment `k` copies `len[k]` bytes from local address `src[k]` to peer address `dst[k]`.
///
/// An empty plan is a valid answer: the sender still reports completion, because the receiver
/// counts every expected writer.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferPlan {
    /// Source addresses on this rank.
    pub src: RVec<u64>,
    /// Destination addresses on the peer.
    pub dst: RVec<u64>,
    /// Fragment sizes in bytes.
    pub len: RVec<u64>,
}

impl TransferPlan {
    /// An empty plan.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends one fragment.
    pub fn push(&mut self, src: u64, dst: u64, len: u64) {
        self.src.push(src);
        self.dst.push(dst);
        self.len.push(len);
    }

    /// Number of fragments.
    pub fn fragments(&self) -> usize {
        self.len.len()
    }

    /// Whether the plan moves nothing.
    pub fn is_empty(&self) -> bool {
        self.len.is_empty()
    }

    /// Total bytes moved.
    pub fn total_bytes(&self) -> u64 {
        self.len.iter().sum()
    }

    /// Iterates over `(src, dst, len)` fragments.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.src
            .iter()
            .zip(self.dst.iter())
            .zip(self.len.iter())
            .map(|((&s, &d), &l)| (s, d, l))
    }

    /// Appends every fragment of `other`.
    pub fn extend(&mut self, other: &TransferPlan) {
        for (s, d, l) in other.iter() {
            self.push(s, d, l);
        }
    }
}

/// A plan in compressed form: fragment patterns, each applied to a list of row pairs.
///
/// A planner that computes one list of `(src offset, dst offset, len)` per matched view pair
/// and applies it to every pair of rows (as the default planner does) can return that
/// structure instead of its expansion: the flat form of a 131,072-token Llama-3-70B TP4 → TP8
/// pair lists 655,360 fragments, this form 160 fragments and 4,096 row pairs. The host
/// validates it in time linear in rows plus patterns, not in fragments, and expands it lazily
/// while it writes.
///
/// The plan's fragments are, for each pattern in order, for each of its row pairs `k` in
/// order, for each of its fragments `f` in order:
///
/// ```text
/// src = my_rows[pattern.src_rows].addresses[pattern.src_row[k]] + pattern.src_offset[f]
/// dst = peer_rows[pattern.dst_rows].addresses[pattern.dst_row[k]] + pattern.dst_offset[f]
/// len = pattern.len[f]
/// ```
///
/// with `my_rows` and `peer_rows` the rows the host passed to
/// [`TransferPlanner::pair_compressed`](crate::TransferPlanner::pair_compressed). Every
/// fragment lies inside one row on each side (`offset + len <= row_bytes`); the host merges
/// fragments that continue each other, across rows too where slots are byte-adjacent.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompressedPlan {
    /// The patterns, in plan order.
    pub patterns: RVec<PlanPattern>,
}

/// One pattern of a [`CompressedPlan`]: fragments inside a pair of rows, and the row pairs
/// they apply to. Both lists are structures of arrays.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanPattern {
    /// Index of the source rows' entry in the sender's rows (`my_rows`).
    pub src_rows: u32,
    /// Index of the destination rows' entry in the peer's rows (`peer_rows`).
    pub dst_rows: u32,
    /// Fragment offsets inside a source row.
    pub src_offset: RVec<u64>,
    /// Fragment offsets inside a destination row.
    pub dst_offset: RVec<u64>,
    /// Fragment sizes in bytes.
    pub len: RVec<u64>,
    /// Source row of each row pair: an index into `my_rows[src_rows].addresses`.
    pub src_row: RVec<u32>,
    /// Destination row of each row pair: an index into `peer_rows[dst_rows].addresses`.
    pub dst_row: RVec<u32>,
}

impl PlanPattern {
    /// An empty pattern from entry `src_rows` of the sender's rows to entry `dst_rows` of the
    /// peer's.
    pub fn new(src_rows: u32, dst_rows: u32) -> Self {
        Self {
            src_rows,
            dst_rows,
            ..Self::default()
        }
    }

    /// Appends one fragment: `len` bytes from offset `src` of a source row to offset `dst` of
    /// a destination row.
    pub fn push_fragment(&mut self, src: u64, dst: u64, len: u64) {
        self.src_offset.push(src);
        self.dst_offset.push(dst);
        self.len.push(len);
    }

    /// Appends one row pair: source row `src` with destination row `dst`.
    pub fn push_rows(&mut self, src: u32, dst: u32) {
        self.src_row.push(src);
        self.dst_row.push(dst);
    }

    /// Fragments per row pair.
    pub fn fragments_per_row(&self) -> usize {
        self.len.len()
    }

    /// Row pairs.
    pub fn row_pairs(&self) -> usize {
        self.src_row.len()
    }

    /// Iterates over the `(src offset, dst offset, len)` fragments of one row pair.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.src_offset
            .iter()
            .zip(self.dst_offset.iter())
            .zip(self.len.iter())
            .map(|((&s, &d), &l)| (s, d, l))
    }

    /// Iterates over the `(src row, dst row)` pairs.
    pub fn rows(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.src_row
            .iter()
            .copied()
            .zip(self.dst_row.iter().copied())
    }
}

/// Why a [`CompressedPlan`] could not be expanded against a pair of row sets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpandError {
    /// The pattern at fault.
    pub pattern: usize,
    /// What is wrong with it.
    pub problem: String,
}

impl std::fmt::Display for ExpandError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pattern {}: {}", self.pattern, self.problem)
    }
}

impl std::error::Error for ExpandError {}

impl CompressedPlan {
    /// An empty plan.
    pub fn new() -> Self {
        Self::default()
    }

    /// Fragments of the expanded plan (before the host merges any), saturating.
    pub fn fragments(&self) -> u64 {
        self.patterns.iter().fold(0u64, |n, p| {
            n.saturating_add((p.fragments_per_row() as u64).saturating_mul(p.row_pairs() as u64))
        })
    }

    /// Bytes the plan moves, saturating.
    pub fn total_bytes(&self) -> u64 {
        self.patterns.iter().fold(0u64, |n, p| {
            let per_row = p.len.iter().fold(0u64, |a, &l| a.saturating_add(l));
            n.saturating_add(per_row.saturating_mul(p.row_pairs() as u64))
        })
    }

    /// The flat form of this plan against the rows it was computed from, in plan order.
    ///
    /// Only resolves addresses: the host still validates the result like any plan.
    ///
    /// # Errors
    ///
    /// An entry or row index outside the rows, arrays of different lengths, or an address
    /// past 2^64.
    pub fn expand(
        &self,
        my_rows: &[crate::LayerGroupRows],
        peer_rows: &[crate::LayerGroupRows],
    ) -> Result<TransferPlan, ExpandError> {
        let mut plan = TransferPlan::new();
        for (i, p) in self.patterns.iter().enumerate() {
            let bad = |problem: String| ExpandError {
                pattern: i,
                problem,
            };
            if p.src_offset.len() != p.len.len() || p.dst_offset.len() != p.len.len() {
                return Err(bad("fragment arrays differ in length".into()));
            }
            if p.src_row.len() != p.dst_row.len() {
                return Err(bad("row-pair arrays differ in length".into()));
            }
            let missing = |rows: &[crate::LayerGroupRows], at: u32, side: &str| {
                bad(format!(
                    "{side} rows entry {at} does not exist ({} entries)",
                    rows.len()
                ))
            };
            let src = my_rows
                .get(p.src_rows as usize)
                .ok_or_else(|| missing(my_rows, p.src_rows, "source"))?;
            let dst = peer_rows
                .get(p.dst_rows as usize)
                .ok_or_else(|| missing(peer_rows, p.dst_rows, "destination"))?;
            let (src, dst) = (&src.addresses[..], &dst.addresses[..]);
            for (k, (s, d)) in p.rows().enumerate() {
                let (Some(&s), Some(&d)) = (src.get(s as usize), dst.get(d as usize)) else {
                    return Err(bad(format!("row pair {k} ({s}, {d}) names a missing row")));
                };
                for (so, dof, len) in p.iter() {
                    let (Some(a), Some(b)) = (s.checked_add(so), d.checked_add(dof)) else {
                        return Err(bad(format!("row pair {k}: an address passes 2^64")));
                    };
                    plan.push(a, b, len);
                }
            }
        }
        Ok(plan)
    }
}
