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
