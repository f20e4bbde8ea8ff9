//! Per-request inputs: slot tables, excluded views, token ranges.

use abi_stable::StableAbi;
use abi_stable::std_types::{ROption, RVec};
use serde::{Deserialize, Serialize};

/// A request's slots in one layer group, indexed by block ordinal.
///
/// PAGED group: entry `o` is the slot holding tokens `[o * tpb, (o + 1) * tpb)`, or `-1` when
/// this side holds nothing there (outside the window, not allocated yet, or — receiver only —
/// already cached). The table has `ceil(prompt_len / tpb)` entries. STATE group: `[slot]`, or
/// empty when the rank holds no state for the request.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotTable {
    /// Slots by ordinal; `-1` marks a hole.
    pub slots: RVec<i64>,
}

impl SlotTable {
    /// The hole marker.
    pub const HOLE: i64 = -1;

    /// A table from slot ids.
    pub fn new(slots: impl IntoIterator<Item = i64>) -> Self {
        Self {
            slots: slots.into_iter().collect(),
        }
    }
}

impl From<Vec<i64>> for SlotTable {
    fn from(slots: Vec<i64>) -> Self {
        Self {
            slots: RVec::from(slots),
        }
    }
}

/// A (layer group, view) pair by index into a page table.
#[repr(C)]
#[derive(
    StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub struct ViewId {
    /// Index into [`crate::PageTable::groups`].
    pub group: u32,
    /// Index into the group's views.
    pub view: u32,
}

/// A block-aligned token range `[start, end)`.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRange {
    /// First token.
    pub start: u64,
    /// One past the last token.
    pub end: u64,
}

/// One piece of a request as the sender plans it.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PairRequest {
    /// Tokens this piece covers (`[0, prompt_len)` for a monolithic send).
    pub token_range: TokenRange,
    /// The request's prompt length in tokens.
    pub prompt_len: u64,
    /// Token where the receiver's table starts to matter (legacy; holes already mask it).
    pub dst_start_token: ROption<u64>,
    /// Whether this is the request's last piece (recurrent state rides on it).
    pub is_last: bool,
}

impl PairRequest {
    /// A monolithic request: the whole prompt in one piece.
    pub fn whole(prompt_len: u64) -> Self {
        Self {
            token_range: TokenRange {
                start: 0,
                end: prompt_len,
            },
            prompt_len,
            dst_start_token: ROption::RNone,
            is_last: true,
        }
    }
}
