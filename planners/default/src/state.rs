//! Receiver payload bytes (semantics §7): the recurrent-state bytes that ride the same
//! write as the paged blocks, used by the host to size a bounce reservation.

use std::collections::HashSet;

use kvferry_planner_abi::{GroupKind, PlanError, RankInfo, SlotTable};

use crate::topology::who;
use crate::view::views;

/// Bytes that land in `me`'s STATE slots for one request, `me` being the receiver and
/// `peer` the sender rank it knows.
///
/// 0 when the receiver holds no STATE slot for the request or either side has no STATE
/// group; otherwise, over every receiver STATE view of a group holding a slot, the number
/// of its global layers that sender STATE views of the same roles also hold, times the
/// view's bytes per layer. Receiver-local by design: independent of the sender's shard
/// pairing (every byte of the overlap arrives, whoever writes it) and of the slot index.
pub(crate) fn receiver_payload_bytes(
    me: &RankInfo,
    peer: &RankInfo,
    slot_tables: &[SlotTable],
) -> Result<u64, PlanError> {
    let groups = me.page_table.groups.len();
    if slot_tables.len() != groups {
        return Err(PlanError::invalid(format!(
            "{} slot tables for the {groups} layer groups of {}",
            slot_tables.len(),
            who(me)
        )));
    }
    let mine =
        views(&me.page_table).map_err(|e| e.context(format!("page table of {}", who(me))))?;
    let theirs =
        views(&peer.page_table).map_err(|e| e.context(format!("page table of {}", who(peer))))?;

    let mut total = 0u64;
    for w in mine.iter().filter(|w| w.class == GroupKind::STATE) {
        let has_slot = slot_tables[w.id.group as usize]
            .slots
            .iter()
            .any(|&s| s != SlotTable::HOLE);
        if !has_slot {
            continue;
        }
        let roles = w.roles();
        let sent: HashSet<u32> = theirs
            .iter()
            .filter(|v| v.class == GroupKind::STATE && v.roles() == roles)
            .flat_map(|v| v.globals())
            .collect();
        let layers = w.globals().filter(|l| sent.contains(l)).count() as u64;
        total = layers
            .checked_mul(w.region())
            .and_then(|b| total.checked_add(b))
            .ok_or_else(|| PlanError::invalid("state payload overflows 2^64 bytes"))?;
    }
    Ok(total)
}
