//! The [`Link`] to one peer rank: the matched view pairs with their mappers and ownership,
//! from which every plan to that peer is made.
//!
//! Only the data lives here; the peer check (`compat`) builds a link, `topology` reads it for
//! the uniform-share answer, `pairing` emits plans from it and `cache` keeps one per peer.

use kvferry_planner_abi::{GroupKind, ViewId};

use crate::mapper::{Frag, Reblock};

/// Everything a sender needs to plan for one peer rank, derived once per peer.
#[derive(Debug)]
pub(crate) struct Link {
    /// Matched view pairs in this rank's page-table order.
    pub(crate) pairs: Vec<ViewPair>,
    /// Peer views holding layers this rank holds that no pair serves (semantics §3.6).
    pub(crate) unserved: Vec<Unserved>,
}

/// One matched (local view, peer view) pair.
#[derive(Debug)]
pub(crate) struct ViewPair {
    /// The local view.
    pub(crate) mine: ViewId,
    /// The peer view.
    pub(crate) theirs: ViewId,
    /// PAGED or STATE (equal on both sides).
    pub(crate) class: GroupKind,
    /// Whether this rank writes the pair into the peer rank (§5.2).
    pub(crate) owned: bool,
    /// `(num_replicas local, num_replicas peer)`.
    pub(crate) replicas: (u32, u32),
    /// Per-row fragments (equal block sizes).
    pub(crate) frags: Vec<Frag>,
    /// The re-blocking mapper when the two sides' blocks hold different token counts.
    pub(crate) reblock: Option<Reblock>,
}

/// A peer view that needs bytes this rank holds but has no view for.
#[derive(Debug)]
pub(crate) struct Unserved {
    /// The peer view.
    pub(crate) view: ViewId,
    /// Its name, for the refusal.
    pub(crate) name: String,
    /// The first global layer it needs that this rank holds.
    pub(crate) layer: u32,
}
