//! Per-peer caches: the [`Link`] (the peer's verdict and plan skeleton) and the targets per
//! peer DP rank, behind one mutex.
//!
//! An entry is keyed by the peer's (instance name, instance rank) and remembers both rank
//! descriptions it was built from; a call with different descriptions (a restarted peer
//! under the same name) rebuilds it, so a stale entry can never route bytes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use kvferry_planner_abi::{PeerTargets, PlanError, RankInfo};

use crate::compat;
use crate::link::Link;
use crate::topology;

#[derive(Debug)]
struct Entry {
    me: RankInfo,
    peer: RankInfo,
    link: Arc<Link>,
    targets: HashMap<u32, PeerTargets>,
}

impl Entry {
    fn built_for(&self, me: &RankInfo, peer: &RankInfo) -> bool {
        self.me == *me && self.peer == *peer
    }
}

/// The caches of one planner instance.
#[derive(Debug, Default)]
pub(crate) struct PeerCache {
    entries: Mutex<HashMap<(String, u32), Entry>>,
}

impl PeerCache {
    /// The caches survive a panic in another thread: every entry is written whole, so a
    /// poisoned lock still guards consistent data.
    fn lock(&self) -> MutexGuard<'_, HashMap<(String, u32), Entry>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The link to `peer`, vetting the peer (semantics §3) on first use. A refusal is not
    /// cached (the host caches verdicts).
    pub(crate) fn link(&self, me: &RankInfo, peer: &RankInfo) -> Result<Arc<Link>, PlanError> {
        let key = peer.peer_key();
        if let Some(entry) = self.lock().get(&key) {
            if entry.built_for(me, peer) {
                return Ok(Arc::clone(&entry.link));
            }
        }
        // Built outside the lock: other peers' plans do not wait for this one.
        let link = Arc::new(compat::check_peer(me, peer)?);
        self.lock().insert(
            key,
            Entry {
                me: me.clone(),
                peer: peer.clone(),
                link: Arc::clone(&link),
                targets: HashMap::new(),
            },
        );
        Ok(link)
    }

    /// The targets for the peer DP group `peer_dp_rank`, computed once per peer and DP rank.
    pub(crate) fn targets(
        &self,
        me: &RankInfo,
        peer: &RankInfo,
        peer_dp_rank: u32,
    ) -> Result<PeerTargets, PlanError> {
        let link = self.link(me, peer)?;
        let key = peer.peer_key();
        if let Some(entry) = self.lock().get(&key) {
            if Arc::ptr_eq(&entry.link, &link) {
                if let Some(t) = entry.targets.get(&peer_dp_rank) {
                    return Ok(t.clone());
                }
            }
        }
        let targets = topology::targets(me, peer, peer_dp_rank, &link)?;
        if let Some(entry) = self.lock().get_mut(&key) {
            if Arc::ptr_eq(&entry.link, &link) {
                entry.targets.insert(peer_dp_rank, targets.clone());
            }
        }
        Ok(targets)
    }

    /// Drops everything kept for `peer`.
    pub(crate) fn forget(&self, peer: &RankInfo) {
        self.lock().remove(&peer.peer_key());
    }

    /// Number of peers cached (tests).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kvferry_planner_abi::{GroupKind, LayoutKind};

    use super::PeerCache;
    use crate::testkit::{V, rank, table};

    fn ranks() -> (kvferry_planner_abi::RankInfo, kvferry_planner_abi::RankInfo) {
        let t = table(&[(
            GroupKind::PAGED,
            &[0, 1, 2, 3],
            &[V(&["key", "value"], LayoutKind::HND, &[0, 1, 2, 3], 64)],
        )]);
        (rank("gen", t.clone()), rank("ctx", t))
    }

    #[test]
    fn a_link_is_built_once_per_peer_and_rebuilt_when_the_peer_changes() {
        let cache = PeerCache::default();
        let (me, peer) = ranks();
        let first = cache.link(&me, &peer).unwrap();
        assert!(Arc::ptr_eq(&first, &cache.link(&me, &peer).unwrap()));
        // The same key with another description (a restarted peer): rebuilt, not reused.
        let mut restarted = peer.clone();
        restarted.page_table.pools[0].base += 0x100;
        let second = cache.link(&me, &restarted).unwrap();
        assert!(!Arc::ptr_eq(&first, &second));
        assert_eq!(cache.len(), 1);
        cache.targets(&me, &restarted, 0).unwrap();
        cache.forget(&restarted);
        assert_eq!(cache.len(), 0);
    }

    #[test]
    fn a_poisoned_lock_is_recovered() {
        let cache = PeerCache::default();
        let (me, peer) = ranks();
        let panicked = std::thread::scope(|s| {
            s.spawn(|| {
                let _guard = cache.lock();
                panic!("poison the cache");
            })
            .join()
        });
        assert!(panicked.is_err());
        assert!(cache.entries.is_poisoned());
        assert_eq!(cache.targets(&me, &peer, 0).unwrap().ranks.as_slice(), &[0]);
    }
}
