//! The cache description a rank publishes: pools, layer groups, views and buffer entries.
//!
//! The model follows `transfer-semantics.md` §2 and §14 (the "G4" page table):
//!
//! ```text
//! PageTable { tokens_per_block, pools[], groups[] }
//!   PhysicalPool { base, slot_bytes, slot_stride, num_slots, memory_type }
//!   LayerGroup   { kind: PAGED | STATE, window, layers[(local, global)], views[] }
//!     PoolView   { pool, entries[(local layer, offset, size)], roles, layout }
//!       RoleLayout { kind: HND | NHD | REPLICATED | SECTIONED, shard/replica geometry }
//! ```
//!
//! A *slot* is one row of a pool: a PAGED pool holds one cache block (`tokens_per_block`
//! tokens of every layer of its group) per slot, a STATE pool one request's recurrent state
//! per slot. The byte address of layer `L` of view `V` in slot `s` is
//! `pool.base + s * pool.slot_stride + entry_offset(L)`.

use std::collections::BTreeSet;
use std::fmt;

use abi_stable::StableAbi;
use abi_stable::std_types::{ROption, RString, RVec};
use serde::{Deserialize, Serialize};

use crate::PlanError;

macro_rules! open_code {
    ($(#[$doc:meta])* $name:ident { $($(#[$cdoc:meta])* $konst:ident = $value:literal => $text:literal,)* }) => {
        $(#[$doc])*
        #[repr(transparent)]
        #[derive(StableAbi, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        pub struct $name(pub u8);

        impl $name {
            $($(#[$cdoc])* pub const $konst: Self = Self($value);)*

            /// The lowercase name of the code, or `None` for a code this build does not know.
            pub fn name(self) -> Option<&'static str> {
                match self.0 {
                    $($value => Some($text),)*
                    _ => None,
                }
            }

            /// Whether this build of `planner-abi` knows the code.
            pub fn is_known(self) -> bool {
                self.name().is_some()
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(self, f)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match self.name() {
                    Some(name) => f.write_str(name),
                    None => write!(f, "unknown({})", self.0),
                }
            }
        }
    };
}

open_code! {
    /// Where a pool lives. An open set of codes (see the crate's evolution chapter).
    MemoryType {
        /// Device (GPU) memory.
        VRAM = 0 => "vram",
        /// Host memory.
        DRAM = 1 => "dram",
    }
}

open_code! {
    /// Whether a layer group is paged by token blocks or holds one state slot per request.
    GroupKind {
        /// Several slots per request, one per `tokens_per_block` tokens; any prefix is valid.
        PAGED = 0 => "paged",
        /// One slot per request holding an exact checkpoint (recurrent state).
        STATE = 1 => "state",
    }
}

open_code! {
    /// How a view's per-layer region is laid out and sharded across ranks.
    LayoutKind {
        /// Head-major buffers `[head][token][dim]`, sharded by head.
        HND = 0 => "hnd",
        /// Token-major buffers `[token][head][dim]`, sharded by head inside every token.
        NHD = 1 => "nhd",
        /// Identical on every rank that holds it.
        REPLICATED = 2 => "replicated",
        /// A per-layer region made of sections (`section_bytes`), each sharded on its own.
        SECTIONED = 3 => "sectioned",
    }
}

/// One physical allocation addressed by slot.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhysicalPool {
    /// Address of slot 0 (a device address for VRAM pools).
    pub base: u64,
    /// Payload bytes of a slot.
    pub slot_bytes: u64,
    /// Distance between consecutive slots; `>= slot_bytes` (larger for padded pools).
    pub slot_stride: u64,
    /// Number of slots.
    pub num_slots: u64,
    /// Where the pool lives.
    pub memory_type: MemoryType,
}

impl PhysicalPool {
    /// Address of `slot`.
    pub fn slot_address(&self, slot: u64) -> u64 {
        self.base + slot * self.slot_stride
    }

    /// Bytes from `base` to the end of the last slot's payload.
    pub fn footprint(&self) -> u64 {
        if self.num_slots == 0 {
            0
        } else {
            (self.num_slots - 1) * self.slot_stride + self.slot_bytes
        }
    }
}

/// A layer's id inside its rank (`local`) and in the whole model (`global`).
///
/// Global ids are collision-free and PP-invariant: every rank names a layer the same way.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalLayer {
    /// Index of the layer on this rank.
    pub local: u32,
    /// Model-wide layer id.
    pub global: u32,
}

/// One buffer of one layer inside a slot.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferEntry {
    /// The layer's local id.
    pub local_layer: u32,
    /// Offset from the slot's start.
    pub offset: u64,
    /// Bytes of the buffer.
    pub size: u64,
}

/// Layout and sharding of one view.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoleLayout {
    /// Byte layout kind.
    pub kind: LayoutKind,
    /// Element type name, e.g. `bf16`, `fp8_e4m3`, `fp32`; compared verbatim between peers.
    pub dtype: RString,
    /// Bits per element (4 for NVFP4, 8 for FP8, 16 for BF16).
    pub elem_bits: u32,
    /// Number of distinct shards the model's region is split into (distinct head groups).
    pub num_shards: u32,
    /// Which shard this rank holds, `< num_shards`.
    pub shard_index: u32,
    /// How many ranks hold the same shard (heads duplicated across TP ranks).
    pub num_replicas: u32,
    /// Which replica this rank is, `< num_replicas`.
    pub replica_index: u32,
    /// Bytes of one shard unit inside a buffer: one head's `[token][dim]` block for HND, one
    /// head of one token for NHD; 0 when not declared. Both sides must agree on it.
    pub shard_unit_bytes: u64,
    /// Section sizes of one layer's region on this rank (SECTIONED only), in order.
    pub section_bytes: RVec<u64>,
}

impl RoleLayout {
    /// An unsharded, unreplicated layout.
    pub fn whole(kind: LayoutKind, dtype: &str, elem_bits: u32) -> Self {
        Self {
            kind,
            dtype: RString::from(dtype),
            elem_bits,
            num_shards: 1,
            shard_index: 0,
            num_replicas: 1,
            replica_index: 0,
            shard_unit_bytes: 0,
            section_bytes: RVec::new(),
        }
    }
}

/// The bytes of one role class inside one pool for one layer group.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolView {
    /// Index into [`PageTable::pools`].
    pub pool: u32,
    /// Buffers of every layer, offsets relative to the slot start.
    pub entries: RVec<BufferEntry>,
    /// Sorted, unique role names (`key`, `value`, `conv`, `ssm`, ...): opaque labels.
    pub roles: RVec<RString>,
    /// Layout and sharding.
    pub layout: RoleLayout,
}

/// One layer's contiguous region inside a view, as resolved by [`PoolView::layer_ranges`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerRange {
    /// Local layer id.
    pub local: u32,
    /// Global layer id.
    pub global: u32,
    /// Offset of the region from the slot start.
    pub offset: u64,
    /// Bytes of the region (equal for every layer of a view).
    pub size: u64,
    /// Buffers the region is made of (2 for K and V); equal for every layer of a view.
    pub buffers: u32,
}

impl PoolView {
    /// The view's roles as a set.
    pub fn role_set(&self) -> BTreeSet<&str> {
        self.roles.iter().map(|r| r.as_str()).collect()
    }

    /// The layers of the view in physical order (by smallest offset), each with its
    /// contiguous region.
    ///
    /// # Errors
    ///
    /// A layer whose buffers are not contiguous, layers of different sizes or buffer counts,
    /// or an entry naming a layer the group does not hold.
    pub fn layer_ranges(&self, group: &LayerGroup) -> Result<Vec<LayerRange>, PlanError> {
        let mut by_layer: Vec<(u32, Vec<BufferEntry>)> = Vec::new();
        for entry in self.entries.iter() {
            match by_layer.iter_mut().find(|(l, _)| *l == entry.local_layer) {
                Some((_, list)) => list.push(*entry),
                None => by_layer.push((entry.local_layer, vec![*entry])),
            }
        }
        let mut ranges = Vec::with_capacity(by_layer.len());
        for (local, mut entries) in by_layer {
            entries.sort_by_key(|e| e.offset);
            let offset = entries[0].offset;
            let mut end = offset;
            for e in &entries {
                if e.offset != end {
                    return Err(PlanError::invalid(format!(
                        "view of pool {}: buffers of local layer {local} are not contiguous \
                         (gap at offset {end})",
                        self.pool
                    )));
                }
                end = e.offset + e.size;
            }
            let global = group.global_id(local).ok_or_else(|| {
                PlanError::invalid(format!(
                    "view of pool {}: entry names local layer {local}, which the group does not \
                     hold",
                    self.pool
                ))
            })?;
            ranges.push(LayerRange {
                local,
                global,
                offset,
                size: end - offset,
                buffers: entries.len() as u32,
            });
        }
        ranges.sort_by_key(|r| r.offset);
        if let Some(first) = ranges.first() {
            if let Some(bad) = ranges
                .iter()
                .find(|r| r.size != first.size || r.buffers != first.buffers)
            {
                return Err(PlanError::invalid(format!(
                    "view of pool {}: layer {} has {} bytes in {} buffers, layer {} has {} bytes \
                     in {} buffers; every layer of a view must match",
                    self.pool,
                    first.global,
                    first.size,
                    first.buffers,
                    bad.global,
                    bad.size,
                    bad.buffers
                )));
            }
        }
        Ok(ranges)
    }
}

/// A set of layers whose slots are allocated together and indexed by one slot table.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerGroup {
    /// PAGED or STATE.
    pub kind: GroupKind,
    /// Live token window for sliding-window attention (`None`: full attention).
    pub window: ROption<u64>,
    /// The layers of the group.
    pub layers: RVec<LocalLayer>,
    /// The views of the group, sorted by (pool, lowest offset).
    pub views: RVec<PoolView>,
}

impl LayerGroup {
    /// The global id of local layer `local`.
    pub fn global_id(&self, local: u32) -> Option<u32> {
        self.layers
            .iter()
            .find(|l| l.local == local)
            .map(|l| l.global)
    }

    /// The window, if any.
    pub fn window(&self) -> Option<u64> {
        self.window.into_option()
    }
}

/// A rank's full cache description.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageTable {
    /// Tokens per PAGED slot (cache block).
    pub tokens_per_block: u32,
    /// Physical pools.
    pub pools: RVec<PhysicalPool>,
    /// Layer groups; a slot table has one entry per group, in this order.
    pub groups: RVec<LayerGroup>,
}

impl PageTable {
    /// Every view of the table, by (group, view) index, in table order.
    pub fn view_ids(&self) -> impl Iterator<Item = crate::ViewId> + '_ {
        self.groups.iter().enumerate().flat_map(|(g, group)| {
            (0..group.views.len()).map(move |v| crate::ViewId {
                group: g as u32,
                view: v as u32,
            })
        })
    }

    /// Structural checks every consumer relies on: known codes, pool indices in range,
    /// entries inside the slot payload, shard indices below their counts, contiguous and
    /// equal-sized layer regions.
    ///
    /// # Errors
    ///
    /// The first violated rule, naming group, view and field.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.tokens_per_block == 0 {
            return Err(PlanError::invalid("page table: tokens_per_block is 0"));
        }
        for (p, pool) in self.pools.iter().enumerate() {
            if pool.slot_stride < pool.slot_bytes {
                return Err(PlanError::invalid(format!(
                    "pool {p}: slot_stride {} is smaller than slot_bytes {}",
                    pool.slot_stride, pool.slot_bytes
                )));
            }
            if !pool.memory_type.is_known() {
                return Err(PlanError::invalid(format!(
                    "pool {p}: memory type {} is not known to this build",
                    pool.memory_type
                )));
            }
            pool.num_slots
                .checked_mul(pool.slot_stride)
                .and_then(|n| n.checked_add(pool.base))
                .ok_or_else(|| PlanError::invalid(format!("pool {p}: address range overflows")))?;
        }
        for (g, group) in self.groups.iter().enumerate() {
            if !group.kind.is_known() {
                return Err(PlanError::invalid(format!(
                    "group {g}: kind {} is not known to this build",
                    group.kind
                )));
            }
            for (v, view) in group.views.iter().enumerate() {
                let at = || format!("group {g} view {v}");
                let pool = self.pools.get(view.pool as usize).ok_or_else(|| {
                    PlanError::invalid(format!("{}: pool {} does not exist", at(), view.pool))
                })?;
                let l = &view.layout;
                if !l.kind.is_known() {
                    return Err(PlanError::invalid(format!(
                        "{}: layout kind {} is not known to this build",
                        at(),
                        l.kind
                    )));
                }
                if l.num_shards == 0 || l.shard_index >= l.num_shards {
                    return Err(PlanError::invalid(format!(
                        "{}: shard_index {} is not below num_shards {}",
                        at(),
                        l.shard_index,
                        l.num_shards
                    )));
                }
                if l.num_replicas == 0 || l.replica_index >= l.num_replicas {
                    return Err(PlanError::invalid(format!(
                        "{}: replica_index {} is not below num_replicas {}",
                        at(),
                        l.replica_index,
                        l.num_replicas
                    )));
                }
                for e in view.entries.iter() {
                    let end = e.offset.checked_add(e.size);
                    if end.is_none_or(|end| end > pool.slot_bytes) {
                        return Err(PlanError::invalid(format!(
                            "{}: entry of local layer {} at offset {} size {} runs past the \
                             slot's {} bytes",
                            at(),
                            e.local_layer,
                            e.offset,
                            e.size,
                            pool.slot_bytes
                        )));
                    }
                }
                let ranges = view.layer_ranges(group).map_err(|e| e.context(at()))?;
                if l.kind == LayoutKind::SECTIONED {
                    let total: u64 = l.section_bytes.iter().sum();
                    if let Some(r) = ranges.first() {
                        if total != r.size {
                            return Err(PlanError::invalid(format!(
                                "{}: sections sum to {total} bytes but a layer holds {}",
                                at(),
                                r.size
                            )));
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
