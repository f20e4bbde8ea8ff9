//! Which slots a request occupies: one free list per DP group.
//!
//! Every rank of a DP group uses the same slot indices for a request (one
//! [`SlotAssignment`], as in [`kvferry_testkit::scenario`]); DP groups are independent. A request takes
//! the lowest free PAGED slots (keeping the used part of a pool compact) in a shuffled order,
//! so ordinals land on scattered, non-adjacent slots as they do in a real cache.

use std::collections::BTreeSet;

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use kvferry_testkit::scenario::SlotAssignment;

/// Why slots could not be allocated.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SlotError {
    /// No such DP group.
    #[error("dp rank {dp} does not exist ({groups} dp groups)")]
    NoGroup {
        /// The DP rank asked for.
        dp: u32,
        /// DP groups of the instance.
        groups: u32,
    },
    /// Not enough free slots.
    #[error("dp group {dp}: {wanted} {kind} slots wanted, {free} free (raise --slots)")]
    Exhausted {
        /// The DP group.
        dp: u32,
        /// `paged` or `state`.
        kind: &'static str,
        /// Slots wanted.
        wanted: u64,
        /// Slots free.
        free: u64,
    },
}

/// The slots one request holds in one DP group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// The DP group.
    pub dp: u32,
    /// Slot of every local ordinal, and the STATE slot.
    pub assignment: SlotAssignment,
    /// Whether the STATE slot was taken from the free list.
    holds_state: bool,
}

#[derive(Clone, Debug)]
struct Group {
    paged: BTreeSet<i64>,
    state: BTreeSet<i64>,
}

/// Free slots of every DP group of an instance.
#[derive(Clone, Debug)]
pub struct SlotPools {
    groups: Vec<Group>,
    has_state: bool,
}

impl SlotPools {
    /// `dp_groups` groups of `paged` PAGED and `state` STATE slots each; `has_state` says
    /// whether the model has STATE groups at all.
    pub fn new(dp_groups: u32, paged: u64, state: u64, has_state: bool) -> Self {
        let group = Group {
            paged: (0..paged as i64).collect(),
            state: (0..state as i64).collect(),
        };
        Self {
            groups: vec![group; dp_groups.max(1) as usize],
            has_state,
        }
    }

    /// Takes `blocks` PAGED slots (and a STATE slot if the model has state) in DP group `dp`,
    /// assigned to ordinals in an order shuffled by `seed`.
    ///
    /// # Errors
    ///
    /// No such group, or not enough free slots.
    pub fn allocate(&mut self, dp: u32, blocks: u64, seed: u64) -> Result<Allocation, SlotError> {
        let groups = self.groups.len() as u32;
        let has_state = self.has_state;
        let group = self
            .groups
            .get_mut(dp as usize)
            .ok_or(SlotError::NoGroup { dp, groups })?;
        if (group.paged.len() as u64) < blocks {
            return Err(SlotError::Exhausted {
                dp,
                kind: "paged",
                wanted: blocks,
                free: group.paged.len() as u64,
            });
        }
        if has_state && group.state.is_empty() {
            return Err(SlotError::Exhausted {
                dp,
                kind: "state",
                wanted: 1,
                free: 0,
            });
        }
        let mut paged: Vec<i64> = group.paged.iter().take(blocks as usize).copied().collect();
        for s in &paged {
            group.paged.remove(s);
        }
        paged.shuffle(&mut StdRng::seed_from_u64(seed));
        let state = if has_state {
            group.state.pop_first().unwrap_or(0)
        } else {
            0
        };
        Ok(Allocation {
            dp,
            assignment: SlotAssignment { paged, state },
            holds_state: has_state,
        })
    }

    /// Returns an allocation's slots.
    pub fn free(&mut self, allocation: &Allocation) {
        if let Some(group) = self.groups.get_mut(allocation.dp as usize) {
            group
                .paged
                .extend(allocation.assignment.paged.iter().copied());
            if allocation.holds_state {
                group.state.insert(allocation.assignment.state);
            }
        }
    }

    /// Free PAGED slots of group `dp`.
    pub fn free_paged(&self, dp: u32) -> u64 {
        self.groups
            .get(dp as usize)
            .map_or(0, |g| g.paged.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_lowest_slots_and_frees_them() {
        let mut pools = SlotPools::new(2, 8, 2, true);
        let a = pools.allocate(1, 3, 7).unwrap();
        let mut got = a.assignment.paged.clone();
        got.sort();
        assert_eq!(got, vec![0, 1, 2]);
        assert_eq!(a.assignment.state, 0);
        assert_eq!(pools.free_paged(1), 5);
        assert_eq!(pools.free_paged(0), 8);
        let err = pools.allocate(1, 6, 0).unwrap_err();
        assert!(matches!(
            err,
            SlotError::Exhausted {
                wanted: 6,
                free: 5,
                ..
            }
        ));
        pools.free(&a);
        assert_eq!(pools.free_paged(1), 8);
        assert!(matches!(
            pools.allocate(2, 1, 0),
            Err(SlotError::NoGroup { dp: 2, groups: 2 })
        ));
    }
}
