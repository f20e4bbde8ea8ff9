//! What a request's slot tables must be before any planner sees them: one table per layer
//! group, every slot inside its pool, no slot named twice in a group, and — the rule a short
//! table broke silently — every PAGED table long enough to cover the tokens the request moves.
//!
//! A slot table is positional (`design/transfer-semantics.md` §8.2): entry `o` is the slot
//! holding block ordinal `o` (under helix CP, local ordinal `o` of this rank: global block
//! `o × cp_size + cp_rank`). A hole (`-1`) is the engine saying "I hold nothing there"
//! (out of the window, cached already, not allocated): nothing moves for it, by the engine's
//! own word. A table that simply *ends* before the request's last block said nothing of the
//! blocks past its end, and before this check the describer read the missing entries as
//! holes: `send` of tokens 0..40 with 16-token blocks and a two-entry table moved 32 tokens
//! and reported the request whole. So a PAGED table must reach the block holding the
//! request's last token; one longer than that is allowed (only the covered blocks move). A
//! STATE table has at most one entry (`[slot]`, or none or a hole: nothing held).

use std::collections::HashSet;

use kvferry_planner_abi::{GroupKind, RankInfo, SlotTable, ViewId};

/// Blocks of a rank's PAGED table needed to cover tokens `0..end`: local ordinals `o` with
/// global block `o × cp_size + cp_rank` below `ceil(end / tokens_per_block)`.
pub fn blocks_needed(info: &RankInfo, end: u64) -> u64 {
    let tpb = u64::from(info.page_table.tokens_per_block.max(1));
    let blocks = end.div_ceil(tpb);
    let cp = u64::from(info.cp_size.max(1));
    let r = u64::from(info.cp_rank).min(cp - 1);
    if blocks <= r {
        0
    } else {
        (blocks - r).div_ceil(cp)
    }
}

/// Checks `tables` (one per layer group of `info`'s page table) for a request that moves
/// tokens up to `end` on this rank. Groups all of whose views are in `excluded` need not
/// cover the range (nothing of them moves).
///
/// # Errors
///
/// The first broken rule, naming the layer group, the views that needed the blocks, the
/// block size and the table's length: a table count that is not the group count, a slot
/// outside its pool, a slot named twice in one group's table, a PAGED table shorter than
/// the range, a STATE table with more than one entry.
pub fn check_slot_tables(
    info: &RankInfo,
    tables: &[SlotTable],
    excluded: &[ViewId],
    end: u64,
) -> Result<(), String> {
    let pt = &info.page_table;
    if tables.len() != pt.groups.len() {
        return Err(format!(
            "{} slot table(s) for {} layer group(s)",
            tables.len(),
            pt.groups.len()
        ));
    }
    let tpb = pt.tokens_per_block.max(1);
    let needed = blocks_needed(info, end);
    let mut seen = HashSet::new();
    for (g, (group, table)) in pt.groups.iter().zip(tables).enumerate() {
        for view in group.views.iter() {
            let Some(pool) = pt.pools.get(view.pool as usize) else {
                return Err(format!(
                    "layer group {g} names pool {}, which does not exist",
                    view.pool
                ));
            };
            if let Some((o, &bad)) = table
                .slots
                .iter()
                .enumerate()
                .find(|&(_, &s)| s != SlotTable::HOLE && (s < 0 || s as u64 >= pool.num_slots))
            {
                return Err(format!(
                    "layer group {g}: block {o} names slot {bad}, outside pool {} ({} slots)",
                    view.pool, pool.num_slots
                ));
            }
        }
        seen.clear();
        for (o, &slot) in table.slots.iter().enumerate() {
            if slot != SlotTable::HOLE && !seen.insert(slot) {
                let first = table.slots.iter().position(|&s| s == slot).unwrap_or(0);
                return Err(format!(
                    "layer group {g}: slot {slot} is named for blocks {first} and {o} of one \
                     request (one slot holds one block)"
                ));
            }
        }
        let moving: Vec<u32> = (0..group.views.len() as u32)
            .filter(|&v| {
                !excluded.contains(&ViewId {
                    group: g as u32,
                    view: v,
                })
            })
            .collect();
        if moving.is_empty() {
            continue;
        }
        if group.kind == GroupKind::STATE {
            if table.slots.len() > 1 {
                return Err(format!(
                    "layer group {g} is a STATE group but its slot table has {} entries (at \
                     most 1)",
                    table.slots.len()
                ));
            }
            continue;
        }
        let len = table.slots.len() as u64;
        if len < needed {
            let views = if moving.len() == group.views.len() {
                "every view".to_string()
            } else {
                let names: Vec<String> = moving.iter().map(u32::to_string).collect();
                format!("views {}", names.join(", "))
            };
            let helix = if info.cp_size > 1 {
                format!(
                    " (this rank holds every {}th block from block {}: {needed} of them)",
                    info.cp_size, info.cp_rank
                )
            } else {
                String::new()
            };
            return Err(format!(
                "layer group {g} ({views}): its slot table has {len} entries of {tpb} tokens \
                 each, but the request's tokens run to {end}, which takes {needed} entries{helix}; \
                 the tokens past the table would not move. Give one entry per block up to the \
                 last token, -1 where this side holds nothing"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvferry_planner_abi::{Mapping, PageTable};

    fn rank(cp: u32, cp_rank: u32) -> RankInfo {
        let mapping: Mapping = format!("tp1cp{cp}").parse().unwrap();
        let table = PageTable {
            tokens_per_block: 16,
            pools: Default::default(),
            groups: Default::default(),
        };
        RankInfo::new("gen", &mapping, cp_rank, vec![1], table)
    }

    #[test]
    fn blocks_needed_counts_this_ranks_blocks_of_the_range() {
        // 40 tokens of 16: blocks 0, 1, 2.
        assert_eq!(blocks_needed(&rank(1, 0), 40), 3);
        assert_eq!(blocks_needed(&rank(1, 0), 32), 2);
        assert_eq!(blocks_needed(&rank(1, 0), 0), 0);
        // Helix CP 2: rank 0 holds blocks 0 and 2, rank 1 block 1.
        assert_eq!(blocks_needed(&rank(2, 0), 40), 2);
        assert_eq!(blocks_needed(&rank(2, 1), 40), 1);
        // CP 4, 2 blocks: ranks 2 and 3 hold none of them.
        assert_eq!(blocks_needed(&rank(4, 1), 32), 1);
        assert_eq!(blocks_needed(&rank(4, 2), 32), 0);
        assert_eq!(blocks_needed(&rank(4, 3), 32), 0);
    }
}
