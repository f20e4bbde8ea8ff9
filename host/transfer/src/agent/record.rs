//! What the test and benchmark harness sets on an agent ([`HarnessOptions`]), and the plans a
//! prefill agent keeps for `kvferry bench` when it records them: the same plans written again
//! by the rank thread's bare put loop, and exported as fragment lists. The agent's calls over
//! them exist only with the `harness` feature.

// Without the `harness` feature plans are never recorded (nothing can switch it on), and
// the agent has no call that reads them back.
#![cfg_attr(not(feature = "harness"), allow(dead_code))]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
#[cfg(feature = "harness")]
use std::sync::mpsc;
#[cfg(feature = "harness")]
use std::time::Duration;

use kvferry_plan::ValidatedPlan;

use crate::memory::RankPools;
use crate::outcome::{PairFragments, PoolFragment};
use crate::rank::{PeerId, RemoteRank};
#[cfg(feature = "harness")]
use crate::rank::{RankThread, ReplayJob, ReplayStats, WriteError};

/// What the harness sets on an agent ([`super::AgentConfig::harness`]); the default, for an
/// engine, sets nothing.
#[derive(Clone, Debug, Default)]
pub struct HarnessOptions {
    /// Observes every write job (fault injection in tests).
    pub hook: Option<Arc<dyn crate::rank::WriteHook>>,
    /// Prefill ranks: keep every written plan until `Agent::forget_recorded`, so
    /// `Agent::replay` can write it again with a bare put loop (`kvferry bench`). Recorded
    /// plans hold memory per request.
    pub record_plans: bool,
}

/// One written plan: where it went, what it wrote.
pub(crate) type Recorded = (Arc<RemoteRank>, Arc<ValidatedPlan>);

/// The recorded plans of every request, in the order they were queued.
#[derive(Debug, Default)]
pub(crate) struct Recorder {
    requests: HashMap<u64, Vec<Recorded>>,
}

impl Recorder {
    pub(crate) fn record(
        &mut self,
        request: u64,
        dest: &Arc<RemoteRank>,
        plan: &Arc<ValidatedPlan>,
    ) {
        self.requests
            .entry(request)
            .or_default()
            .push((Arc::clone(dest), Arc::clone(plan)));
    }

    /// The plans of those of `requests` this rank wrote (ascending id, each request's plans
    /// as queued).
    pub(crate) fn plans(&self, requests: &[u64]) -> Vec<Recorded> {
        let ids: BTreeSet<u64> = requests.iter().copied().collect();
        ids.iter()
            .filter_map(|id| self.requests.get(id))
            .flat_map(|plans| plans.iter().cloned())
            .collect()
    }

    pub(crate) fn has(&self, request: u64) -> bool {
        self.requests.contains_key(&request)
    }

    pub(crate) fn forget(&mut self, requests: &[u64]) {
        for id in requests {
            self.requests.remove(id);
        }
    }
}

/// Queues the bare replay of `plans` on `thread`; its outcome arrives on the receiver.
#[cfg(feature = "harness")]
pub(crate) fn replay(
    thread: &RankThread,
    plans: Vec<Recorded>,
    timeout: Duration,
) -> mpsc::Receiver<Result<ReplayStats, WriteError>> {
    let (tx, rx) = mpsc::channel();
    thread.replay(ReplayJob {
        plans,
        timeout,
        done: Box::new(move |result| {
            let _ = tx.send(result);
        }),
        release: None,
    });
    rx
}

/// `plans` of prefill rank `c` as fragment lists per decode rank it wrote, relative to
/// each side's pools: exactly what [`replay`] puts, in its order. Pairs come in order of first
/// appearance.
pub(crate) fn fragments(
    c: u32,
    pools: &RankPools,
    plans: &[Recorded],
) -> Result<Vec<PairFragments>, String> {
    let mut pairs: Vec<((PeerId, u32), PairFragments)> = Vec::new();
    let mut index: BTreeMap<(PeerId, u32), usize> = BTreeMap::new();
    for (dest, plan) in plans {
        let key = (dest.peer, dest.rank);
        let k = *index.entry(key).or_insert_with(|| {
            pairs.push((
                key,
                PairFragments {
                    ctx_rank: c,
                    gen_rank: dest.rank,
                    src_pools: (0..pools.len())
                        .filter_map(|p| pools.region(p).map(|r| r.len() as u64))
                        .collect(),
                    dst_pools: dest.pools.iter().map(|p| p.len).collect(),
                    ..PairFragments::default()
                },
            ));
            pairs.len() - 1
        });
        let pair = &mut pairs[k].1;
        pair.plans.push(plan.len() as u64);
        pair.bytes += plan.total_bytes();
        pair.fragments.reserve(plan.len());
        for (src, dst, len) in plan.fragments() {
            let (sp, so) = pools.locate(src, len).ok_or_else(|| {
                format!("prefill rank {c}: source {src:#x}+{len} lies outside its pools")
            })?;
            let dp = dest.pool_of(dst, len).ok_or_else(|| {
                format!(
                    "decode rank {}: destination {dst:#x}+{len} lies outside its pools",
                    dest.rank
                )
            })?;
            let d = &dest.pools[dp];
            pair.fragments.push(PoolFragment(
                sp as u32,
                so as u64,
                dp as u32,
                dst - d.base,
                len,
            ));
        }
    }
    Ok(pairs.into_iter().map(|(_, p)| p).collect())
}
