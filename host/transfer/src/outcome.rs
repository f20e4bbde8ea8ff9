//! What a request moved and where its time went; what the bench's baselines moved.

use serde::{Deserialize, Serialize};

pub use kvferry_protocol::{RequestStats, Stages};

/// What a prefill server's bare replay of recorded plans moved, and how long it took
/// ([`crate::agent::Agent::replay`]).
#[cfg_attr(not(feature = "harness"), allow(dead_code))]
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
    /// Prefill ranks that replayed.
    pub ranks: u32,
    /// Where the time went, summed over the ranks: `puts` and `flush` for the replay, `copy`
    /// for the memcpy baseline.
    pub stages: Stages,
}

#[cfg_attr(not(feature = "harness"), allow(dead_code))]
impl BenchStats {
    /// Adds another server's part of the same run, which ran at the same time: the totals
    /// add up, the time is the longest.
    pub fn merge(&mut self, other: &BenchStats) {
        self.elapsed_ns = self.elapsed_ns.max(other.elapsed_ns);
        self.bytes += other.bytes;
        self.fragments += other.fragments;
        self.puts += other.puts;
        self.plans += other.plans;
        self.ranks += other.ranks;
        self.stages.merge(&other.stages);
    }
}

/// One fragment of a recorded plan, relative to the pools it reads and writes: `(source
/// pool, offset in it, destination pool, offset in it, bytes)`. A tuple so that it is one
/// small array in JSON.
#[cfg_attr(not(feature = "harness"), allow(dead_code))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolFragment(pub u32, pub u64, pub u32, pub u64, pub u64);

#[cfg_attr(not(feature = "harness"), allow(dead_code))]
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

/// What a prefill server's recorded plans of some requests write from one of its ranks to
/// one decode rank, exactly the coalesced fragments [`crate::agent::Agent::replay`] puts,
/// in its order ([`crate::agent::Agent::recorded_fragments`]).
#[cfg_attr(not(feature = "harness"), allow(dead_code))]
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PairFragments {
    /// The context (sender) rank.
    pub ctx_rank: u32,
    /// The decode (receiver) rank.
    pub gen_rank: u32,
    /// Bytes of each of the prefill rank's pools, in page-table order.
    pub src_pools: Vec<u64>,
    /// Bytes of each of the decode rank's pools, in page-table order.
    pub dst_pools: Vec<u64>,
    /// Fragments of each plan, in order (the replay gives each plan one window and one
    /// flush); they sum to `fragments.len()`.
    pub plans: Vec<u64>,
    /// Bytes of all fragments.
    pub bytes: u64,
    /// The fragments, plan after plan.
    pub fragments: Vec<PoolFragment>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merging_adds_counts_and_stages_and_keeps_the_longest_latency() {
        let stages = |k: u64| Stages {
            plan_ns: k,
            validate_ns: 2 * k,
            gather_ns: 3 * k,
            puts_ns: 4 * k,
            flush_ns: 5 * k,
            scatter_ns: 6 * k,
            control_ns: 7 * k,
            queue_ns: 8 * k,
            copy_ns: 9 * k,
            digest_ns: 10 * k,
        };
        let mut a = RequestStats {
            bytes: 10,
            fragments: 2,
            writers: 1,
            pieces: 1,
            latency_us: 50,
            puts: 4,
            stages: stages(1),
        };
        a.merge(&RequestStats {
            bytes: 5,
            fragments: 1,
            writers: 1,
            pieces: 2,
            latency_us: 40,
            puts: 1,
            stages: stages(10),
        });
        assert_eq!(
            a,
            RequestStats {
                bytes: 15,
                fragments: 3,
                writers: 2,
                pieces: 3,
                latency_us: 50,
                puts: 5,
                stages: stages(11),
            }
        );
        assert_eq!(a.stages.total_ns(), 55 * 11);

        let mut b = BenchStats {
            elapsed_ns: 7,
            bytes: 1,
            fragments: 1,
            puts: 2,
            plans: 1,
            ranks: 1,
            stages: stages(1),
        };
        b.merge(&BenchStats {
            elapsed_ns: 9,
            ..b.clone()
        });
        assert_eq!((b.elapsed_ns, b.bytes, b.puts, b.ranks), (9, 2, 4, 2));
        assert_eq!(b.stages, stages(2));
    }
}
