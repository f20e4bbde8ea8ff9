//! Hand-built ranks for tests: page tables of any shape, the [`RankInfo`] of any rank of any
//! mapping, slot tables, rows and pieces, and one request between two hand-built deployments
//! checked byte for byte by the oracle.
//!
//! [`crate::layout`] lays out the published models; this module lays out whatever a test needs,
//! at three levels:
//!
//! - [`page_table`] lays out any [`GroupSpec`]s: PAGED or STATE groups, windows, views of any
//!   [`RoleLayout`] (HND, NHD, SECTIONED, REPLICATED; shards, replicas, shard units,
//!   sections). Every view gets a pool of its own; a slot holds the group's layers back to
//!   back, each layer's buffers back to back. The presets are laid out by it too.
//! - [`rank_info`] wraps a page table in the [`RankInfo`] of one rank of a [`Mapping`]
//!   (CP-minor instance ranks, one DP group per TP rank under attention DP).
//! - [`Model`] describes a small synthetic model (GQA in HND or NHD, MLA, sliding windows,
//!   MTP layers, hybrid attention plus recurrent state) and [`Deploy`] an instance of it;
//!   [`Deploy::rank`] builds any rank's [`RankInfo`] the way the cache managers of semantics
//!   §2.3 lay it out. [`crate::scenario::Transfer`] moves one request between two deployments with any
//!   planner and checks every byte ([`crate::scenario::Exchange`]).
//!
//! Tests that call a planner directly use the small pieces: [`tables`] and [`crate::scenario::request_tables`]
//! (slot tables), [`scattered`] (a positional table with holes), [`rows_of`] and
//! [`rows_excluding`] (the default describer's rows), [`piece`] (a [`PairRequest`]),
//! [`local_layers`] and [`role_vec`] (page-table fields).
//!
//! # Layout of a [`Model`]
//!
//! Per rank:
//! - attention: one PAGED group, one pool, one view; a slot holds, for each local attention
//!   layer, `[K][V]` (MLA: `[K]` only), each buffer HND `[head][token][dim]` or NHD
//!   `[token][head][dim]`;
//! - recurrent state: one STATE group with two pools, conv (SECTIONED, every section split
//!   over the state grid) and SSM (HND, `[head][...]`), plus an optional REPLICATED `side`
//!   view in a third; one slot per request.
//!
//! Local layer ids count a group's layers on the rank (`0, 1, ...`). Shard declarations
//! follow semantics §14: distinct head shards `min(tp, heads)`, replicas `tp / shards` when TP
//! exceeds the KV heads, MLA one shard replicated over TP (one replica under attention DP),
//! state grid `tp × cp` (CP-minor) or 1 under attention DP.
//!
//! [`Deploy::rank`] places pool `p` of rank `r` of deployment `id` at
//! `id << 44 | r << 36 | p << 30`, so ranks of different deployments never overlap and an
//! address names its deployment, rank and pool.

use std::ops::Range;

use kvferry_planner_abi::ffi::{ROption, RString, RVec};
use kvferry_planner_abi::{
    BufferEntry, GroupKind, LayerGroup, LayerGroupRows, LayoutKind, LocalLayer, Mapping,
    MemoryType, PageTable, PairRequest, PhysicalPool, PoolView, RankInfo, RoleLayout, SlotTable,
    TokenRange, ViewId, rows,
};

// ---------------------------------------------------------------------------------------------
// Pool sizing and rank coordinates.

/// How pools are sized and placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolOptions {
    /// Slots of every PAGED pool.
    pub paged_slots: u64,
    /// Slots of every STATE pool.
    pub state_slots: u64,
    /// Bytes added after every slot's payload (`slot_stride = slot_bytes + slot_padding`).
    pub slot_padding: u64,
    /// Where the pools live.
    pub memory_type: MemoryType,
}

impl Default for PoolOptions {
    /// 64 PAGED slots, 1 STATE slot, no padding, VRAM.
    fn default() -> Self {
        Self {
            paged_slots: 64,
            state_slots: 1,
            slot_padding: 0,
            memory_type: MemoryType::VRAM,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Any page table.

/// A view to lay out: a pool of its own holding, per layer of its group, `buffers` buffers of
/// `buffer_bytes` back to back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ViewSpec {
    /// Role names, e.g. `["key", "value"]`.
    pub roles: Vec<String>,
    /// Layout declaration, taken as given.
    pub layout: RoleLayout,
    /// Buffers per layer (K and V: 2).
    pub buffers: u32,
    /// Bytes of one buffer.
    pub buffer_bytes: u64,
}

impl ViewSpec {
    /// A view with `roles`, `buffers` buffers of `buffer_bytes` per layer, laid out as
    /// `layout`.
    pub fn new(roles: &[&str], layout: RoleLayout, buffers: u32, buffer_bytes: u64) -> Self {
        Self {
            roles: roles.iter().map(|r| (*r).to_string()).collect(),
            layout,
            buffers,
            buffer_bytes,
        }
    }
}

/// A layer group to lay out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupSpec {
    /// PAGED or STATE.
    pub kind: GroupKind,
    /// Sliding window in tokens.
    pub window: Option<u64>,
    /// The group's layers, in slot order.
    pub layers: Vec<LocalLayer>,
    /// Its views.
    pub views: Vec<ViewSpec>,
}

/// Lays `groups` out in pools, one per view, skipping groups without layers.
///
/// PAGED pools get `options.paged_slots` slots, STATE pools `options.state_slots`, every slot
/// `options.slot_padding` bytes of padding. `alloc(pool, footprint)` returns the base of the
/// `pool`-th pool ([`PhysicalPool::footprint`] bytes).
pub fn page_table(
    tokens_per_block: u32,
    groups: Vec<GroupSpec>,
    options: &PoolOptions,
    alloc: &mut dyn FnMut(usize, u64) -> u64,
) -> PageTable {
    let mut pools = RVec::new();
    let mut out = RVec::new();
    for spec in groups.into_iter().filter(|s| !s.layers.is_empty()) {
        let num_slots = if spec.kind == GroupKind::STATE {
            options.state_slots
        } else {
            options.paged_slots
        };
        let mut views = RVec::new();
        for view in spec.views {
            let layer_bytes = u64::from(view.buffers) * view.buffer_bytes;
            let mut entries = RVec::new();
            for (k, layer) in spec.layers.iter().enumerate() {
                for b in 0..u64::from(view.buffers) {
                    entries.push(BufferEntry {
                        local_layer: layer.local,
                        offset: k as u64 * layer_bytes + b * view.buffer_bytes,
                        size: view.buffer_bytes,
                    });
                }
            }
            let slot_bytes = spec.layers.len() as u64 * layer_bytes;
            let mut pool = PhysicalPool {
                base: 0,
                slot_bytes,
                slot_stride: slot_bytes + options.slot_padding,
                num_slots,
                memory_type: options.memory_type,
            };
            pool.base = alloc(pools.len(), pool.footprint());
            views.push(PoolView {
                pool: pools.len() as u32,
                entries,
                roles: view
                    .roles
                    .iter()
                    .map(|r| RString::from(r.as_str()))
                    .collect(),
                layout: view.layout,
            });
            pools.push(pool);
        }
        out.push(LayerGroup {
            kind: spec.kind,
            window: spec.window.into(),
            layers: RVec::from(spec.layers),
            views,
        });
    }
    PageTable {
        tokens_per_block,
        pools,
        groups: out,
    }
}

/// Bytes [`page_table`] would lay `groups` out in: the sum of its pools' footprints, in
/// `u128` (saturating) so that a layout too large for `u64` addresses is measured rather than
/// overflowed. A caller checks it before [`page_table`] hands the footprints to an allocator.
pub fn pools_bytes(groups: &[GroupSpec], options: &PoolOptions) -> u128 {
    let mut total: u128 = 0;
    for spec in groups.iter().filter(|s| !s.layers.is_empty()) {
        let slots = u128::from(if spec.kind == GroupKind::STATE {
            options.state_slots
        } else {
            options.paged_slots
        });
        for view in &spec.views {
            let slot = (spec.layers.len() as u128)
                .saturating_mul(u128::from(view.buffers))
                .saturating_mul(u128::from(view.buffer_bytes));
            let footprint = match slots.checked_sub(1) {
                None => 0,
                Some(rest) => rest
                    .saturating_mul(slot.saturating_add(u128::from(options.slot_padding)))
                    .saturating_add(slot),
            };
            total = total.saturating_add(footprint);
        }
    }
    total
}

/// Bytes of the largest slot of any view of `groups` (`u64::MAX` where one would not fit).
pub fn largest_slot(groups: &[GroupSpec]) -> u64 {
    groups
        .iter()
        .flat_map(|spec| {
            spec.views.iter().map(|view| {
                (spec.layers.len() as u64)
                    .checked_mul(u64::from(view.buffers))
                    .and_then(|n| n.checked_mul(view.buffer_bytes))
                    .unwrap_or(u64::MAX)
            })
        })
        .max()
        .unwrap_or(0)
}

/// The [`RankInfo`] of instance rank `rank` of `mapping`, holding `page_table`.
///
/// Coordinates are CP-minor ([`Mapping::coords`]); under attention DP every TP rank is its own
/// DP group (`dp_size = tp`, `dp_rank = tp_rank`). The describer is the default one and the
/// planner blob empty.
pub fn rank_info(
    instance_name: &str,
    mapping: &Mapping,
    rank: u32,
    layers_per_pp: Vec<u32>,
    page_table: PageTable,
    planner_id: &str,
) -> RankInfo {
    RankInfo::new(instance_name, mapping, rank, layers_per_pp, page_table).with_planner(planner_id)
}

/// `(local, global)` layers in order: local ids `0, 1, ...` for `globals`.
pub fn local_layers(globals: &[u32]) -> RVec<LocalLayer> {
    globals
        .iter()
        .enumerate()
        .map(|(i, &g)| LocalLayer {
            local: i as u32,
            global: g,
        })
        .collect()
}

/// Role names as the ABI stores them.
pub fn role_vec(roles: &[&str]) -> RVec<RString> {
    roles.iter().map(|r| RString::from(*r)).collect()
}

// ---------------------------------------------------------------------------------------------
// Synthetic models and their deployments.

/// The recurrent-state part of a hybrid [`Model`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateSpec {
    /// Global ids of the recurrent layers.
    pub layers: Vec<u32>,
    /// Conv sections of one layer at state grid 1, in bytes (e.g. `[x | B | C]`).
    pub conv_sections: Vec<u64>,
    /// SSM heads of one layer at grid 1.
    pub ssm_heads: u32,
    /// Bytes of one SSM head (head_dim × d_state × elem).
    pub ssm_head_bytes: u64,
    /// An extra replicated side-state view (role `side`) of this many bytes per layer.
    pub replicated_side: Option<u64>,
}

/// A synthetic model's cache geometry (see the module docs for its layout).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Model {
    /// Model layers (PP splits these; global ids `0..layers`).
    pub layers: u32,
    /// Global ids of the attention layers (a subset of `0..layers`, or extra MTP ids).
    pub attn: Vec<u32>,
    /// KV heads of the model (1 for MLA).
    pub kv_heads: u32,
    /// Elements per head (MLA: the latent width).
    pub head_dim: u32,
    /// Bytes per element.
    pub elem_bytes: u32,
    /// Element type name, as a [`RoleLayout`] carries it.
    pub dtype: &'static str,
    /// Tokens per block.
    pub tpb: u32,
    /// HND or NHD.
    pub layout: LayoutKind,
    /// MLA: one `{key}` latent view, never sharded.
    pub mla: bool,
    /// Sliding window of the attention group.
    pub window: Option<u64>,
    /// Recurrent state.
    pub state: Option<StateSpec>,
    /// Slots per pool.
    pub slots: u64,
    /// Bytes of padding after every slot.
    pub slot_padding: u64,
    /// Each attention layer a group of its own (one view, one pool per layer), as vLLM
    /// keeps one tensor per layer: what layer-wise sends split by.
    pub layer_groups: bool,
}

impl Model {
    /// A GQA model with `layers` attention layers, `kv_heads` heads of `head_dim` BF16
    /// elements, HND, 8 slots per pool.
    pub fn gqa(layers: u32, kv_heads: u32, head_dim: u32, tpb: u32) -> Self {
        Self {
            layers,
            attn: (0..layers).collect(),
            kv_heads,
            head_dim,
            elem_bytes: 2,
            dtype: "bf16",
            tpb,
            layout: LayoutKind::HND,
            mla: false,
            window: None,
            state: None,
            slots: 8,
            slot_padding: 0,
            layer_groups: false,
        }
    }

    /// Llama-3-70B (semantics §12.2): 80 layers, 8 KV heads of 128, BF16, tpb 32, 4 slots.
    pub fn llama70b() -> Self {
        Self {
            slots: 4,
            ..Self::gqa(80, 8, 128, 32)
        }
    }

    /// An MLA model (DeepSeek style): one latent "head" of `latent` BF16 elements.
    pub fn mla(layers: u32, latent: u32, tpb: u32) -> Self {
        Self {
            mla: true,
            kv_heads: 1,
            ..Self::gqa(layers, 1, latent, tpb)
        }
    }

    /// A small hybrid: `layers` layers, every `every`-th attention (4 KV heads of 4, tpb 4),
    /// the rest recurrent (conv sections `[64 | 32 | 32]`, 4 SSM heads of 16 bytes).
    pub fn hybrid(layers: u32, every: u32) -> Self {
        let attn: Vec<u32> = (0..layers).filter(|l| l % every == every - 1).collect();
        let state: Vec<u32> = (0..layers).filter(|l| l % every != every - 1).collect();
        Self {
            attn,
            state: Some(StateSpec {
                layers: state,
                conv_sections: vec![64, 32, 32],
                ssm_heads: 4,
                ssm_head_bytes: 16,
                replicated_side: None,
            }),
            ..Self::gqa(layers, 4, 4, 4)
        }
    }

    /// The same model with `layers` attention layers (e.g. one extra MTP layer).
    pub fn with_layers(mut self, layers: u32) -> Self {
        self.layers = layers;
        self.attn = (0..layers).collect();
        self
    }

    /// Bytes of one head of one token.
    pub fn head_token_bytes(&self) -> u64 {
        u64::from(self.head_dim) * u64::from(self.elem_bytes)
    }
}

/// Where a rank sits in its attention view: `(num_shards, shard_index, num_replicas,
/// replica_index, heads on the rank)`.
pub type AttentionShards = (u32, u32, u32, u32, u32);

/// An instance of a [`Model`]: its name, address space, mapping and PP split.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Deploy {
    /// Instance name.
    pub name: String,
    /// Distinguishes the instances' synthetic addresses.
    pub id: u64,
    /// The parallel mapping.
    pub mapping: Mapping,
    /// Model layers per PP stage.
    pub layers_per_pp: Vec<u32>,
    /// The planner id stamped on every rank.
    pub planner_id: String,
}

impl Deploy {
    /// Instance `name` of `model` under `mapping`, its pools at addresses keyed by `id`, the
    /// layers split evenly over the PP stages (earlier stages take the remainder), planner id
    /// `kvferry.default`.
    pub fn new(name: &str, id: u64, mapping: Mapping, model: &Model) -> Self {
        let pp = mapping.pp.max(1);
        let (base, extra) = (model.layers / pp, model.layers % pp);
        Self {
            name: name.to_string(),
            id,
            mapping,
            layers_per_pp: (0..pp).map(|p| base + u32::from(p < extra)).collect(),
            planner_id: "kvferry.default".to_string(),
        }
    }

    /// A prefill instance (`prefill`, address id 1) with TP `tp`, every other axis 1.
    pub fn context(tp: u32, model: &Model) -> Self {
        let mapping = Mapping {
            tp,
            pp: 1,
            cp: 1,
            moe_tp: tp,
            moe_ep: 1,
            attention_dp: false,
        };
        Self::new("prefill", 1, mapping, model)
    }

    /// A decode instance (`decode`, address id 2) with TP `tp`, every other axis 1.
    pub fn generation(tp: u32, model: &Model) -> Self {
        Self {
            name: "decode".to_string(),
            id: 2,
            ..Self::context(tp, model)
        }
    }

    /// This instance with attention DP.
    pub fn adp(mut self) -> Self {
        self.mapping.attention_dp = true;
        self
    }

    /// This instance with CP `cp`.
    pub fn cp(mut self, cp: u32) -> Self {
        self.mapping.cp = cp;
        self
    }

    /// This instance with the given PP split.
    pub fn pp(mut self, layers_per_pp: Vec<u32>) -> Self {
        self.mapping.pp = layers_per_pp.len() as u32;
        self.layers_per_pp = layers_per_pp;
        self
    }

    /// This instance with planner id `id` on every rank.
    pub fn planner(mut self, id: &str) -> Self {
        self.planner_id = id.to_string();
        self
    }

    /// Ranks in the instance.
    pub fn world(&self) -> u32 {
        self.mapping.world_size()
    }

    /// DP groups: TP under attention DP, else 1.
    pub fn dp_groups(&self) -> u32 {
        self.mapping.dp_groups()
    }

    /// TP width of one DP group.
    pub fn tp_per_dp(&self) -> u32 {
        if self.mapping.attention_dp {
            1
        } else {
            self.mapping.tp
        }
    }

    /// Global model layers held by PP stage `pp`.
    pub fn stage_layers(&self, pp: u32) -> Range<u32> {
        let start: u32 = self.layers_per_pp[..pp as usize].iter().sum();
        start..start + self.layers_per_pp[pp as usize]
    }

    /// How the attention view of TP rank `tp_rank` is sharded.
    pub fn attn_shards(&self, model: &Model, tp_rank: u32) -> AttentionShards {
        let width = self.tp_per_dp();
        let r = tp_rank % width;
        if model.mla {
            return (1, 0, width, r, 1);
        }
        let heads = model.kv_heads;
        if width <= heads {
            (width, r, 1, 0, heads / width)
        } else {
            let replicas = width / heads;
            (heads, r / replicas, replicas, r % replicas, 1)
        }
    }

    /// `(grid, index)` of the recurrent state of a rank (semantics §3.4 `mamba_tp`).
    pub fn state_grid(&self, tp_rank: u32, cp_rank: u32) -> (u32, u32) {
        if self.mapping.attention_dp {
            (1, 0)
        } else {
            let cp = self.mapping.cp;
            (self.mapping.tp * cp, tp_rank * cp + cp_rank)
        }
    }

    /// Base address of pool `pool` of rank `rank` (see the module docs).
    pub fn base(&self, rank: u32, pool: u32) -> u64 {
        (self.id << 44) | (u64::from(rank) << 36) | (u64::from(pool) << 30)
    }

    /// The description of rank `rank`, pools at [`base`](Self::base).
    pub fn rank(&self, model: &Model, rank: u32) -> RankInfo {
        self.rank_in(model, rank, &mut |r, p, _| self.base(r, p as u32))
    }

    /// The description of rank `rank`, pool `p` at `alloc(rank, p, footprint)` (the
    /// allocator of [`crate::layout::build_instance`]).
    pub fn rank_in(
        &self,
        model: &Model,
        rank: u32,
        alloc: &mut dyn FnMut(u32, usize, u64) -> u64,
    ) -> RankInfo {
        rank_info(
            &self.name,
            &self.mapping,
            rank,
            self.layers_per_pp.clone(),
            self.page_table_in(model, rank, alloc),
            &self.planner_id,
        )
    }

    /// Every rank's description, in rank order.
    pub fn instance(&self, model: &Model) -> Vec<RankInfo> {
        (0..self.world()).map(|r| self.rank(model, r)).collect()
    }

    /// The page table of rank `rank`, pools at [`base`](Self::base).
    pub fn page_table(&self, model: &Model, rank: u32) -> PageTable {
        self.page_table_in(model, rank, &mut |r, p, _| self.base(r, p as u32))
    }

    /// The page table of rank `rank`, pools from `alloc` as in [`rank_in`](Self::rank_in).
    pub fn page_table_in(
        &self,
        model: &Model,
        rank: u32,
        alloc: &mut dyn FnMut(u32, usize, u64) -> u64,
    ) -> PageTable {
        let options = PoolOptions {
            paged_slots: model.slots,
            state_slots: model.slots,
            slot_padding: model.slot_padding,
            memory_type: MemoryType::VRAM,
        };
        page_table(
            model.tpb,
            self.groups(model, rank),
            &options,
            &mut |p, bytes| alloc(rank, p, bytes),
        )
    }

    /// The layer groups rank `rank` holds, before layout.
    pub fn groups(&self, model: &Model, rank: u32) -> Vec<GroupSpec> {
        let coords = self.mapping.coords(rank);
        let held = self.stage_layers(coords.pp);
        let mut groups = Vec::new();
        let attn: Vec<u32> = model
            .attn
            .iter()
            .copied()
            .filter(|l| held.contains(l))
            .collect();
        if !attn.is_empty() {
            let (shards, index, replicas, replica, heads) = self.attn_shards(model, coords.tp);
            let tpb = u64::from(model.tpb);
            let roles: &[&str] = if model.mla {
                &["key"]
            } else {
                &["key", "value"]
            };
            let unit = if model.layout == LayoutKind::NHD {
                model.head_token_bytes()
            } else {
                tpb * model.head_token_bytes()
            };
            let layout = RoleLayout {
                num_shards: shards,
                shard_index: index,
                num_replicas: replicas,
                replica_index: replica,
                shard_unit_bytes: unit,
                ..RoleLayout::whole(model.layout, model.dtype, model.elem_bytes * 8)
            };
            let buffer = tpb * u64::from(heads) * model.head_token_bytes();
            let view = ViewSpec::new(roles, layout, roles.len() as u32, buffer);
            let layers = local_layers(&attn).to_vec();
            if model.layer_groups {
                groups.extend(layers.into_iter().map(|layer| GroupSpec {
                    kind: GroupKind::PAGED,
                    window: model.window,
                    layers: vec![layer],
                    views: vec![view.clone()],
                }));
            } else {
                groups.push(GroupSpec {
                    kind: GroupKind::PAGED,
                    window: model.window,
                    layers,
                    views: vec![view],
                });
            }
        }
        let Some(state) = &model.state else {
            return groups;
        };
        let layers: Vec<u32> = state
            .layers
            .iter()
            .copied()
            .filter(|l| held.contains(l))
            .collect();
        if layers.is_empty() {
            return groups;
        }
        let (grid, index) = self.state_grid(coords.tp, coords.cp);
        let sections: Vec<u64> = state
            .conv_sections
            .iter()
            .map(|s| s / u64::from(grid))
            .collect();
        let sharded = |kind, unit| RoleLayout {
            num_shards: grid,
            shard_index: index,
            shard_unit_bytes: unit,
            ..RoleLayout::whole(kind, "fp32", 32)
        };
        let conv = ViewSpec::new(
            &["conv"],
            RoleLayout {
                section_bytes: RVec::from(sections.clone()),
                ..sharded(LayoutKind::SECTIONED, 0)
            },
            1,
            sections.iter().sum(),
        );
        let ssm = ViewSpec::new(
            &["ssm"],
            sharded(LayoutKind::HND, state.ssm_head_bytes),
            1,
            u64::from(state.ssm_heads / grid) * state.ssm_head_bytes,
        );
        let mut views = vec![conv, ssm];
        if let Some(side) = state.replicated_side {
            // Every rank of the state grid holds the whole view: one replica each.
            let (replicas, replica) = (grid, index);
            views.push(ViewSpec::new(
                &["side"],
                RoleLayout {
                    num_replicas: replicas,
                    replica_index: replica,
                    ..RoleLayout::whole(LayoutKind::REPLICATED, "fp32", 32)
                },
                1,
                side,
            ));
        }
        groups.push(GroupSpec {
            kind: GroupKind::STATE,
            window: None,
            layers: local_layers(&layers).to_vec(),
            views,
        });
        groups
    }
}

// ---------------------------------------------------------------------------------------------
// Slot tables, rows, pieces.

/// Slot tables for a page table: every PAGED group gets `paged`, every STATE group `state`.
pub fn tables(pt: &PageTable, paged: &[i64], state: &[i64]) -> Vec<SlotTable> {
    pt.groups
        .iter()
        .map(|g| {
            if g.kind == GroupKind::PAGED {
                SlotTable::new(paged.iter().copied())
            } else {
                SlotTable::new(state.iter().copied())
            }
        })
        .collect()
}

/// A positional table of `n` ordinals: ordinal `o` in slot `(o × 3 + shift) % slots` (a
/// permutation when `slots` is not a multiple of 3), ordinals in `holes` masked to
/// [`SlotTable::HOLE`].
pub fn scattered(n: u64, slots: u64, shift: u64, holes: &[u64]) -> Vec<i64> {
    (0..n)
        .map(|o| {
            if holes.contains(&o) {
                SlotTable::HOLE
            } else {
                ((o * 3 + shift) % slots) as i64
            }
        })
        .collect()
}

/// The default describer's rows of `ri` for `tables`, no view excluded.
///
/// # Panics
///
/// When the tables do not fit the page table (a test set-up error).
pub fn rows_of(ri: &RankInfo, tables: &[SlotTable]) -> Vec<LayerGroupRows> {
    rows_excluding(ri, tables, &[])
}

/// The default describer's rows of `ri` for `tables`, without the `excluded` views.
///
/// # Panics
///
/// As [`rows_of`].
pub fn rows_excluding(
    ri: &RankInfo,
    tables: &[SlotTable],
    excluded: &[ViewId],
) -> Vec<LayerGroupRows> {
    rows(&ri.page_table, tables, excluded).unwrap_or_else(|e| panic!("rows: {e}"))
}

/// A piece `[start, end)` of a `prompt`-token request.
pub fn piece(start: u64, end: u64, prompt: u64, is_last: bool) -> PairRequest {
    PairRequest {
        token_range: TokenRange { start, end },
        prompt_len: prompt,
        dst_start_token: ROption::RNone,
        is_last,
    }
}
