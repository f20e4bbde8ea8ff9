//! What a request moved, and the callback that hands its slots back.

use serde::{Deserialize, Serialize};

/// What a completed request moved.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestStats {
    /// Bytes written into the receiver ranks.
    pub bytes: u64,
    /// Fragments written.
    pub fragments: u64,
    /// (sender, receiver) rank pairs that reported.
    pub writers: u32,
    /// Pieces reported over all writers.
    pub pieces: u32,
    /// From the generation server's first `RequestData` to the last completion.
    pub latency_us: u64,
}

/// What a context server's bare replay of recorded plans moved, and how long it took
/// ([`crate::agent::Agent::replay`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BenchStats {
    /// From the first rank's first put to the last rank's last flush, in nanoseconds.
    pub elapsed_ns: u64,
    /// Bytes written.
    pub bytes: u64,
    /// Fragments written (after coalescing).
    pub fragments: u64,
    /// Puts issued (fragments split at the executor's largest put).
    pub puts: u64,
    /// Plans replayed (one window and one flush each).
    pub plans: u64,
    /// Context ranks that replayed.
    pub ranks: u32,
}

/// One fragment of a recorded plan, relative to the pools it reads and writes: `(source
/// pool, offset in it, destination pool, offset in it, bytes)`. A tuple so that it is one
/// small array in JSON.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolFragment(pub u32, pub u64, pub u32, pub u64, pub u64);

impl PoolFragment {
    /// Bytes the fragment moves.
    pub fn len(&self) -> u64 {
        self.4
    }

    /// Whether it moves nothing (validated plans have no such fragment).
    pub fn is_empty(&self) -> bool {
        self.4 == 0
    }
}

/// What a context server's recorded plans of some requests write from one of its ranks to
/// one generation rank, exactly the coalesced fragments [`crate::agent::Agent::replay`] puts,
/// in its order ([`crate::agent::Agent::recorded_fragments`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PairFragments {
    /// The context (sender) rank.
    pub ctx_rank: u32,
    /// The generation (receiver) rank.
    pub gen_rank: u32,
    /// Bytes of each of the context rank's pools, in page-table order.
    pub src_pools: Vec<u64>,
    /// Bytes of each of the generation rank's pools, in page-table order.
    pub dst_pools: Vec<u64>,
    /// Fragments of each plan, in order (the replay gives each plan one window and one
    /// flush); they sum to `fragments.len()`.
    pub plans: Vec<u64>,
    /// Bytes of all fragments.
    pub bytes: u64,
    /// The fragments, plan after plan.
    pub fragments: Vec<PoolFragment>,
}
