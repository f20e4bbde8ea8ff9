//! Rows: what one side holds for one request, and the default describer that computes them.

use abi_stable::StableAbi;
use abi_stable::std_types::RVec;
use serde::{Deserialize, Serialize};

use crate::{GroupKind, PageTable, PlanError, SlotTable, ViewId};

/// Id of [`rows`], the describer every planner in this crate's ecosystem uses.
pub const DEFAULT_DESCRIBER_ID: &str = "kvferry.default_describer";

/// The rows one side holds for one (layer group, view) of one request.
///
/// Row `k` is the slot holding block ordinal `ordinals[k]` and starts at `addresses[k]`; it
/// carries `row_bytes` bytes, of which the view's entries say which belong to which layer.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerGroupRows {
    /// The view these rows belong to.
    pub view: ViewId,
    /// PAGED or STATE (copied from the group).
    pub kind: GroupKind,
    /// Block ordinals of the rows present, ascending (STATE: one row, ordinal 0).
    pub ordinals: RVec<u64>,
    /// Slot start address of every row: `base + slot * slot_stride`.
    pub addresses: RVec<u64>,
    /// Payload bytes of a row (the pool's `slot_bytes`).
    pub row_bytes: u64,
    /// Distance between consecutive slots of the pool (`slot_stride`).
    pub row_stride: u64,
    /// First ordinal the slot table spans.
    pub span_start: u64,
    /// One past the last ordinal the slot table spans.
    pub span_end: u64,
}

impl LayerGroupRows {
    /// Number of rows.
    pub fn len(&self) -> usize {
        self.ordinals.len()
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.ordinals.is_empty()
    }

    /// The address of the row holding `ordinal`, if present.
    pub fn address_of(&self, ordinal: u64) -> Option<u64> {
        self.ordinals
            .binary_search(&ordinal)
            .ok()
            .map(|k| self.addresses[k])
    }
}

/// The default describer: one row per held slot at `base + slot * slot_stride`, one entry per
/// (layer group, view), in page-table order. Excluded views produce no entry, so nothing can
/// be written to or read from them.
///
/// `slot_tables` has one table per layer group of `page_table`.
///
/// # Errors
///
/// A table count that differs from the group count, a slot below `-1` or not below the
/// pool's `num_slots`, a STATE table with more than one entry, or an excluded view that does
/// not exist.
pub fn rows(
    page_table: &PageTable,
    slot_tables: &[SlotTable],
    excluded_views: &[ViewId],
) -> Result<Vec<LayerGroupRows>, PlanError> {
    if slot_tables.len() != page_table.groups.len() {
        return Err(PlanError::invalid(format!(
            "{} slot tables for {} layer groups",
            slot_tables.len(),
            page_table.groups.len()
        )));
    }
    for ex in excluded_views {
        let exists = page_table
            .groups
            .get(ex.group as usize)
            .is_some_and(|g| (ex.view as usize) < g.views.len());
        if !exists {
            return Err(PlanError::invalid(format!(
                "excluded view (group {}, view {}) does not exist",
                ex.group, ex.view
            )));
        }
    }
    let mut out = Vec::new();
    for (g, (group, table)) in page_table.groups.iter().zip(slot_tables).enumerate() {
        if group.kind == GroupKind::STATE && table.slots.len() > 1 {
            return Err(PlanError::invalid(format!(
                "group {g} is a STATE group but its slot table has {} entries (at most 1)",
                table.slots.len()
            )));
        }
        for (v, view) in group.views.iter().enumerate() {
            let id = ViewId {
                group: g as u32,
                view: v as u32,
            };
            if excluded_views.contains(&id) {
                continue;
            }
            let pool = page_table.pools.get(view.pool as usize).ok_or_else(|| {
                PlanError::invalid(format!(
                    "group {g} view {v}: pool {} does not exist",
                    view.pool
                ))
            })?;
            let mut ordinals = RVec::new();
            let mut addresses = RVec::new();
            for (o, &slot) in table.slots.iter().enumerate() {
                if slot == SlotTable::HOLE {
                    continue;
                }
                if slot < 0 || slot as u64 >= pool.num_slots {
                    return Err(PlanError::invalid(format!(
                        "group {g}: ordinal {o} names slot {slot}, outside pool {} of {} slots",
                        view.pool, pool.num_slots
                    )));
                }
                ordinals.push(o as u64);
                addresses.push(pool.slot_address(slot as u64));
            }
            out.push(LayerGroupRows {
                view: id,
                kind: group.kind,
                ordinals,
                addresses,
                row_bytes: pool.slot_bytes,
                row_stride: pool.slot_stride,
                span_start: 0,
                span_end: table.slots.len() as u64,
            });
        }
    }
    Ok(out)
}
