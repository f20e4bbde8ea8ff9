//! Bounce-region sizing (`transfer-semantics.md` §9.2): how large a contiguous landing region
//! a receiver must reserve so that its writers can each send one large write instead of
//! thousands of fragments, and when a request must not bounce at all.
//!
//! A bounced request is gathered by the sender into one contiguous send slot, written with one
//! put into the receiver's region, and scattered there into the real destinations. This module
//! only decides the size and the gates, from the receiver's page table and slot tables, the
//! recurrent-state bytes its planner reports ([`TransferPlanner::receiver_payload_bytes`]),
//! the writer count and the targets' `uniform` flag; `kvferry plan` reports it per receiver so
//! an operator can size an arena. Planners stay out of it, as the semantics require.
//!
//! Multi-writer bounce is off by default ([`BounceLimits::fan_in`]): the newest reference
//! refuses it because divisibility and uniform slot sizes do not bound what a remote writer
//! submits (§9.1), and a wrong split would land one writer's bytes in another's share.
//!
//! [`TransferPlanner::receiver_payload_bytes`]: kvferry_planner_abi::TransferPlanner::receiver_payload_bytes

use std::collections::BTreeSet;

use kvferry_planner_abi::{GroupKind, PageTable, SlotTable};

/// The reference's default for [`BounceLimits::min_blocks`].
pub const DEFAULT_MIN_BLOCKS: u64 = 96;

/// The thresholds a reservation must pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BounceLimits {
    /// Bytes the receiver's arena can hold; larger requests go per fragment.
    pub capacity: u64,
    /// Fewer paged blocks than this are not worth a bounce (requests without state).
    pub min_blocks: u64,
    /// Fewer bytes than this are not worth a bounce (requests carrying state, whose blocks
    /// may be few while the state is large).
    pub min_bytes: u64,
    /// Whether several writers may split one region equally when the targets are uniform.
    pub fan_in: bool,
}

impl Default for BounceLimits {
    /// No arena bound (the size is what an arena would need), the reference's 96-block
    /// threshold, no byte threshold, single writer only.
    fn default() -> Self {
        BounceLimits {
            capacity: u64::MAX,
            min_blocks: DEFAULT_MIN_BLOCKS,
            min_bytes: 0,
            fan_in: false,
        }
    }
}

impl BounceLimits {
    /// The default limits without the block and byte thresholds (`--bounce on`): every
    /// request with at least one block or byte passes them.
    pub fn without_thresholds() -> Self {
        BounceLimits {
            min_blocks: 1,
            min_bytes: 1,
            ..BounceLimits::default()
        }
    }
}

/// A region to reserve: `writers` equal shares of `total / writers` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reservation {
    /// Bytes of the whole region.
    pub total: u64,
    /// Writers sharing it.
    pub writers: u32,
    /// Paged blocks it holds.
    pub blocks: u64,
    /// Recurrent-state bytes it holds beyond the blocks.
    pub extra: u64,
}

impl Reservation {
    /// Bytes of each writer's share; writer `i` writes at `base + i × share`.
    pub fn share(&self) -> u64 {
        self.total / u64::from(self.writers)
    }
}

/// Why a request goes per fragment instead of bouncing. Each is a normal outcome, not an
/// error: the transfer proceeds, only without the bounce.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BounceSkip {
    /// The slot tables do not line up with the page table.
    #[error("{tables} slot tables for {groups} layer groups")]
    Tables {
        /// Slot tables given.
        tables: usize,
        /// Layer groups of the page table.
        groups: usize,
    },
    /// A paged group holds blocks for the request but no pool to size them by.
    #[error("layer group {group} holds {blocks} blocks but no pool gives their size")]
    UnknownBlockSize {
        /// The group.
        group: usize,
        /// Its blocks in the request.
        blocks: u64,
    },
    /// No writer targets the receiver.
    #[error("no writer targets this receiver")]
    NoWriters,
    /// Nothing to move.
    #[error("the request holds no bytes to bounce")]
    Empty,
    /// Several writers and multi-writer bounce disabled.
    #[error(
        "{writers} writers, and multi-writer bounce is off: nothing bounds a remote writer's extent"
    )]
    FanInDisabled {
        /// Writers.
        writers: u32,
    },
    /// Several writers whose targets are not uniform (§9.1).
    #[error("{writers} writers with non-uniform shares")]
    NotUniform {
        /// Writers.
        writers: u32,
    },
    /// Recurrent state with several writers: per-writer state shares may differ.
    #[error("{extra} state bytes with {writers} writers")]
    StateWithFanIn {
        /// State bytes.
        extra: u64,
        /// Writers.
        writers: u32,
    },
    /// Below the byte threshold (requests with state).
    #[error("{total} bytes is below the {min} byte threshold")]
    TooFewBytes {
        /// Region bytes.
        total: u64,
        /// Threshold.
        min: u64,
    },
    /// Below the block threshold (requests without state).
    #[error("{blocks} blocks is below the {min} block threshold")]
    TooFewBlocks {
        /// Paged blocks.
        blocks: u64,
        /// Threshold.
        min: u64,
    },
    /// Several writers and a region that does not split evenly.
    #[error("{total} bytes do not split evenly over {writers} writers")]
    Uneven {
        /// Region bytes.
        total: u64,
        /// Writers.
        writers: u32,
    },
    /// Several writers and paged groups whose block sizes differ, so writers' shares of
    /// each group need not be equal.
    #[error(
        "paged groups have different block sizes {sizes:?}; {writers} writers cannot share equally"
    )]
    MixedBlockSizes {
        /// The distinct block sizes, ascending.
        sizes: Vec<u64>,
        /// Writers.
        writers: u32,
    },
    /// Larger than the arena.
    #[error("{total} bytes exceed the {capacity} byte arena; raise the bounce arena size")]
    OverCapacity {
        /// Region bytes.
        total: u64,
        /// Arena bytes.
        capacity: u64,
    },
    /// The size overflows 2^64.
    #[error("the region size overflows 2^64 bytes")]
    Overflow,
}

/// Bytes of one block of each layer group: the slot bytes of the group's distinct pools
/// (several views of one pool count once), `None` for STATE groups, whose bytes travel as
/// the planner's payload instead.
pub fn block_bytes_per_group(page_table: &PageTable) -> Vec<Option<u64>> {
    page_table
        .groups
        .iter()
        .map(|group| {
            (group.kind == GroupKind::PAGED).then(|| {
                let pools: BTreeSet<u32> = group.views.iter().map(|v| v.pool).collect();
                pools
                    .iter()
                    .filter_map(|&p| page_table.pools.get(p as usize))
                    .map(|p| p.slot_bytes)
                    .sum()
            })
        })
        .collect()
}

/// The region a receiver reserves for one request, or why the request goes per fragment.
///
/// `extra` is the planner's [`receiver_payload_bytes`] for the request (0 when the receiver
/// holds no state slot), `writers` the number of targets and `uniform` their flag.
///
/// [`receiver_payload_bytes`]: kvferry_planner_abi::TransferPlanner::receiver_payload_bytes
pub fn reserve(
    page_table: &PageTable,
    slot_tables: &[SlotTable],
    extra: u64,
    writers: u32,
    uniform: bool,
    limits: &BounceLimits,
) -> Result<Reservation, BounceSkip> {
    let groups = page_table.groups.len();
    if slot_tables.len() != groups {
        return Err(BounceSkip::Tables {
            tables: slot_tables.len(),
            groups,
        });
    }
    if writers == 0 {
        return Err(BounceSkip::NoWriters);
    }
    if writers > 1 {
        if !limits.fan_in {
            return Err(BounceSkip::FanInDisabled { writers });
        }
        if !uniform {
            return Err(BounceSkip::NotUniform { writers });
        }
    }
    let (mut blocks, mut total) = (0u64, extra);
    let mut block_sizes = BTreeSet::new();
    for (group, (bytes, table)) in block_bytes_per_group(page_table)
        .into_iter()
        .zip(slot_tables)
        .enumerate()
    {
        let held = table.slots.iter().filter(|&&s| s >= 0).count() as u64;
        match bytes {
            // STATE: its bytes are `extra`.
            None => continue,
            _ if held == 0 => continue,
            Some(0) => {
                return Err(BounceSkip::UnknownBlockSize {
                    group,
                    blocks: held,
                });
            }
            Some(b) => {
                block_sizes.insert(b);
                blocks += held;
                total = held
                    .checked_mul(b)
                    .and_then(|t| total.checked_add(t))
                    .ok_or(BounceSkip::Overflow)?;
            }
        }
    }
    if total == 0 {
        return Err(BounceSkip::Empty);
    }
    if extra > 0 && writers > 1 {
        return Err(BounceSkip::StateWithFanIn { extra, writers });
    }
    if extra > 0 {
        if total < limits.min_bytes {
            return Err(BounceSkip::TooFewBytes {
                total,
                min: limits.min_bytes,
            });
        }
    } else if blocks < limits.min_blocks {
        return Err(BounceSkip::TooFewBlocks {
            blocks,
            min: limits.min_blocks,
        });
    }
    if writers > 1 {
        if total % u64::from(writers) != 0 {
            return Err(BounceSkip::Uneven { total, writers });
        }
        if block_sizes.len() > 1 {
            return Err(BounceSkip::MixedBlockSizes {
                sizes: block_sizes.into_iter().collect(),
                writers,
            });
        }
    }
    if total > limits.capacity {
        return Err(BounceSkip::OverCapacity {
            total,
            capacity: limits.capacity,
        });
    }
    Ok(Reservation {
        total,
        writers,
        blocks,
        extra,
    })
}

// ---------------------------------------------------------------------------------------
// The packed image of a bounced piece.

/// The sender's gather list for a bounced piece: its plan's fragments `(src, dst, len)` in
/// ascending destination order. Copied one after another they make the piece's *packed
/// image*: the destination bytes the piece writes, in address order, with nothing between.
///
/// The image depends only on the set of destination bytes, not on how a plan orders or cuts
/// its fragments, so a receiver that plans the same piece itself (with stand-in sources,
/// [`stand_in_tables`]) scatters it with [`scatter_runs`] without trusting anything the
/// sender says about where bytes go. Fragments of one validated plan never overlap in their
/// destinations, so the order is total.
pub fn gather_list(plan: &crate::ValidatedPlan) -> Vec<(u64, u64, u64)> {
    let mut list: Vec<(u64, u64, u64)> = plan.fragments().collect();
    list.sort_unstable_by_key(|&(_, dst, _)| dst);
    list
}

/// The receiver's scatter runs for a bounced piece: the destination ranges `(address, len)`
/// its own plan of the piece writes, ascending and merged where they touch. The packed image
/// ([`gather_list`]) is their concatenation.
pub fn scatter_runs(plan: &crate::ValidatedPlan) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = plan.fragments().map(|(_, dst, len)| (dst, len)).collect();
    runs.sort_unstable_by_key(|&(dst, _)| dst);
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(runs.len());
    for (dst, len) in runs {
        match merged.last_mut() {
            Some((at, n)) if *at + *n == dst => *n += len,
            _ => merged.push((dst, len)),
        }
    }
    merged
}

/// Stand-in slot tables of a sender whose real ones a receiver does not know: for every
/// layer group of `sender`'s page table, one slot per block of a `prompt_len`-token prompt
/// (paged groups) or one slot (state groups), numbered from 0 and wrapped at the smallest
/// pool of the group. A plan made with them writes the same destination bytes as the
/// sender's real plan (planners choose destinations from the receiver's tables and the
/// token range, and the sender's slots only as sources), so a receiver uses them to check
/// a writer's byte count and to scatter its bounced pieces.
pub fn stand_in_tables(sender: &PageTable, prompt_len: u64) -> Vec<SlotTable> {
    let blocks = prompt_len.div_ceil(u64::from(sender.tokens_per_block.max(1)));
    sender
        .groups
        .iter()
        .map(|g| {
            let slots = g
                .views
                .iter()
                .filter_map(|v| sender.pools.get(v.pool as usize))
                .map(|p| p.num_slots)
                .min()
                .unwrap_or(1)
                .max(1);
            let n = if g.kind == GroupKind::PAGED {
                blocks
            } else {
                1
            };
            SlotTable::new((0..n).map(|i| (i % slots) as i64))
        })
        .collect()
}
