//! Fixtures for the default planner's tests: page tables of GQA (HND or NHD), MLA and hybrid
//! (attention + recurrent state) models for any TP / PP / CP / attention-DP mapping, built the
//! way the cache managers of semantics §2.3 lay them out, plus a byte-level oracle.
//!
//! Layouts (per rank):
//! - attention: one PAGED group, one pool, one view; slot = for each local layer `[K][V]`
//!   (MLA: `[K]` only), each buffer HND `[head][token][dim]` or NHD `[token][head][dim]`;
//! - recurrent state: one STATE group, two pools: conv (SECTIONED, sections split by the
//!   state grid) and SSM (HND, `[head][...]`), one slot per request.
//!
//! Shard declarations follow semantics §14: distinct head shards `min(tp, heads)`, replicas
//! `tp / shards` when TP exceeds the KV heads, MLA one shard replicated over TP (one replica
//! under attention DP), state grid `tp × cp` (CP-minor) or 1 under attention DP.

#![allow(dead_code)]

pub mod oracle;

use kvferry_planner_abi::ffi::{ROption, RString, RVec};
use kvferry_planner_abi::{
    BufferEntry, GroupKind, LayerGroup, LayerGroupRows, LayoutKind, LocalLayer, MemoryType,
    PageTable, PairRequest, PhysicalPool, PoolView, RankInfo, RoleLayout, SlotTable, TokenRange,
    ViewId, rows,
};

/// Recurrent-state part of a hybrid model.
#[derive(Clone, Debug)]
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

/// A model's cache geometry.
#[derive(Clone, Debug)]
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
    /// Element type name.
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
}

impl Model {
    /// A GQA model with `layers` attention layers, BF16.
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
        }
    }

    /// Llama-3-70B (semantics §12.2): 80 layers, 8 KV heads of 128, BF16, tpb 32.
    pub fn llama70b() -> Self {
        Self {
            slots: 4,
            ..Self::gqa(80, 8, 128, 32)
        }
    }

    /// An MLA model (DeepSeek style): one latent "head" of `latent` elements.
    pub fn mla(layers: u32, latent: u32, tpb: u32) -> Self {
        Self {
            mla: true,
            kv_heads: 1,
            ..Self::gqa(layers, 1, latent, tpb)
        }
    }

    /// A small hybrid: `layers` layers, every `every`-th attention, the rest recurrent.
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

    /// The same model with `layers` attention layers.
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

/// An instance's parallel mapping.
#[derive(Clone, Debug)]
pub struct Deploy {
    /// Instance name.
    pub name: &'static str,
    /// Distinguishes the instances' synthetic addresses.
    pub id: u64,
    pub tp: u32,
    pub pp: u32,
    pub cp: u32,
    pub adp: bool,
    /// Model layers per PP stage.
    pub layers_per_pp: Vec<u32>,
}

impl Deploy {
    /// A context instance with TP `tp`, every other axis 1.
    pub fn ctx(tp: u32, model: &Model) -> Self {
        Self {
            name: "ctx",
            id: 1,
            tp,
            pp: 1,
            cp: 1,
            adp: false,
            layers_per_pp: vec![model.layers],
        }
    }

    /// A generation instance with TP `tp`.
    pub fn gen_tp(tp: u32, model: &Model) -> Self {
        Self {
            name: "gen",
            id: 2,
            ..Self::ctx(tp, model)
        }
    }

    /// This mapping with attention DP.
    pub fn adp(mut self) -> Self {
        self.adp = true;
        self
    }

    /// This mapping with CP `cp`.
    pub fn cp(mut self, cp: u32) -> Self {
        self.cp = cp;
        self
    }

    /// This mapping with the given PP split.
    pub fn pp(mut self, layers_per_pp: Vec<u32>) -> Self {
        self.pp = layers_per_pp.len() as u32;
        self.layers_per_pp = layers_per_pp;
        self
    }

    /// Ranks in the instance.
    pub fn world(&self) -> u32 {
        self.tp * self.pp * self.cp
    }

    /// `(pp, tp, cp)` of a flat rank (CP-minor).
    pub fn coords(&self, rank: u32) -> (u32, u32, u32) {
        let pp = rank / (self.tp * self.cp);
        let tp = rank % (self.tp * self.cp) / self.cp;
        (pp, tp, rank % self.cp)
    }

    /// TP width of one DP group.
    pub fn tp_per_dp(&self) -> u32 {
        if self.adp { 1 } else { self.tp }
    }

    /// The rank's description with its page table.
    pub fn rank(&self, model: &Model, rank: u32) -> RankInfo {
        let (pp, tp, cp) = self.coords(rank);
        RankInfo {
            instance_name: RString::from(self.name),
            instance_rank: rank,
            tp_size: self.tp,
            tp_rank: tp,
            pp_size: self.pp,
            pp_rank: pp,
            cp_size: self.cp,
            cp_rank: cp,
            dp_size: if self.adp { self.tp } else { 1 },
            dp_rank: if self.adp { tp } else { 0 },
            attention_dp: self.adp,
            layers_per_pp: RVec::from(self.layers_per_pp.clone()),
            page_table: self.page_table(model, rank),
            planner_id: RString::from("kvferry.default"),
            describer_id: RString::from(kvferry_planner_abi::DEFAULT_DESCRIBER_ID),
            planner_blob: RVec::new(),
        }
    }

    /// Global model layers held by PP stage `pp`.
    pub fn stage_layers(&self, pp: u32) -> std::ops::Range<u32> {
        let start: u32 = self.layers_per_pp[..pp as usize].iter().sum();
        start..start + self.layers_per_pp[pp as usize]
    }

    /// `(num_shards, shard_index, num_replicas, replica_index, heads on this rank)` of the
    /// attention view.
    pub fn attn_shards(&self, model: &Model, tp_rank: u32) -> (u32, u32, u32, u32, u32) {
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

    /// `(grid, index)` of the recurrent state (semantics §3.4 `mamba_tp`).
    pub fn state_grid(&self, tp_rank: u32, cp_rank: u32) -> (u32, u32) {
        if self.adp {
            (1, 0)
        } else {
            (self.tp * self.cp, tp_rank * self.cp + cp_rank)
        }
    }

    /// Base address of one pool of one rank.
    pub fn base(&self, rank: u32, pool: u32) -> u64 {
        (self.id << 44) | (u64::from(rank) << 36) | (u64::from(pool) << 30)
    }

    /// The rank's page table.
    pub fn page_table(&self, model: &Model, rank: u32) -> PageTable {
        let (pp, tp, cp) = self.coords(rank);
        let held = self.stage_layers(pp);
        let mut pools = Vec::new();
        let mut groups = Vec::new();

        let attn: Vec<u32> = model
            .attn
            .iter()
            .copied()
            .filter(|l| held.contains(l))
            .collect();
        if !attn.is_empty() {
            let (shards, index, replicas, replica, heads) = self.attn_shards(model, tp);
            let tpb = u64::from(model.tpb);
            let buffer = tpb * u64::from(heads) * model.head_token_bytes();
            let buffers: u64 = if model.mla { 1 } else { 2 };
            let unit = if model.layout == LayoutKind::NHD {
                model.head_token_bytes()
            } else {
                tpb * model.head_token_bytes()
            };
            let mut entries = Vec::new();
            for (i, _) in attn.iter().enumerate() {
                for b in 0..buffers {
                    entries.push(BufferEntry {
                        local_layer: i as u32,
                        offset: (i as u64 * buffers + b) * buffer,
                        size: buffer,
                    });
                }
            }
            let slot = attn.len() as u64 * buffers * buffer;
            pools.push(self.pool(rank, 0, slot, model.slots));
            let roles: &[&str] = if model.mla {
                &["key"]
            } else {
                &["key", "value"]
            };
            groups.push(LayerGroup {
                kind: GroupKind::PAGED,
                window: model.window.into(),
                layers: local_layers(&attn),
                views: RVec::from(vec![PoolView {
                    pool: 0,
                    entries: RVec::from(entries),
                    roles: role_vec(roles),
                    layout: RoleLayout {
                        num_shards: shards,
                        shard_index: index,
                        num_replicas: replicas,
                        replica_index: replica,
                        shard_unit_bytes: unit,
                        ..RoleLayout::whole(model.layout, model.dtype, model.elem_bytes * 8)
                    },
                }]),
            });
        }

        if let Some(state) = &model.state {
            let layers: Vec<u32> = state
                .layers
                .iter()
                .copied()
                .filter(|l| held.contains(l))
                .collect();
            if !layers.is_empty() {
                let (grid, index) = self.state_grid(tp, cp);
                let n = layers.len() as u64;
                let sections: Vec<u64> = state
                    .conv_sections
                    .iter()
                    .map(|s| s / u64::from(grid))
                    .collect();
                let conv: u64 = sections.iter().sum();
                let ssm = u64::from(state.ssm_heads / grid) * state.ssm_head_bytes;
                let first = pools.len() as u32;
                pools.push(self.pool(rank, first, n * conv, model.slots));
                pools.push(self.pool(rank, first + 1, n * ssm, model.slots));
                let per_layer = |size: u64| -> RVec<BufferEntry> {
                    (0..n)
                        .map(|i| BufferEntry {
                            local_layer: i as u32,
                            offset: i * size,
                            size,
                        })
                        .collect()
                };
                let sharded = |kind, unit| RoleLayout {
                    num_shards: grid,
                    shard_index: index,
                    shard_unit_bytes: unit,
                    ..RoleLayout::whole(kind, "fp32", 32)
                };
                let mut views = vec![
                    PoolView {
                        pool: first,
                        entries: per_layer(conv),
                        roles: role_vec(&["conv"]),
                        layout: RoleLayout {
                            section_bytes: RVec::from(sections),
                            ..sharded(LayoutKind::SECTIONED, 0)
                        },
                    },
                    PoolView {
                        pool: first + 1,
                        entries: per_layer(ssm),
                        roles: role_vec(&["ssm"]),
                        layout: sharded(LayoutKind::HND, state.ssm_head_bytes),
                    },
                ];
                if let Some(side) = state.replicated_side {
                    let p = pools.len() as u32;
                    pools.push(self.pool(rank, p, n * side, model.slots));
                    let (replicas, replica) = if self.adp {
                        (1, 0)
                    } else {
                        (self.tp * self.cp, tp * self.cp + cp)
                    };
                    views.push(PoolView {
                        pool: p,
                        entries: per_layer(side),
                        roles: role_vec(&["side"]),
                        layout: RoleLayout {
                            num_replicas: replicas,
                            replica_index: replica,
                            ..RoleLayout::whole(LayoutKind::REPLICATED, "fp32", 32)
                        },
                    });
                }
                groups.push(LayerGroup {
                    kind: GroupKind::STATE,
                    window: ROption::RNone,
                    layers: local_layers(&layers),
                    views: RVec::from(views),
                });
            }
        }

        PageTable {
            tokens_per_block: model.tpb,
            pools: RVec::from(pools),
            groups: RVec::from(groups),
        }
    }

    fn pool(&self, rank: u32, pool: u32, slot_bytes: u64, slots: u64) -> PhysicalPool {
        PhysicalPool {
            base: self.base(rank, pool),
            slot_bytes,
            slot_stride: slot_bytes,
            num_slots: slots,
            memory_type: MemoryType::VRAM,
        }
    }
}

/// `(local, global)` layers in order.
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

/// A positional table of `n` ordinals, slot `(o × 3 + shift) % slots` (a permutation when
/// `slots` is not a multiple of 3), with `holes` masked to -1.
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

/// Rows of a rank for slot tables, no excluded view.
pub fn rows_of(ri: &RankInfo, tables: &[SlotTable]) -> Vec<LayerGroupRows> {
    rows(&ri.page_table, tables, &[]).expect("rows")
}

/// Rows with excluded views.
pub fn rows_excluding(
    ri: &RankInfo,
    tables: &[SlotTable],
    excluded: &[ViewId],
) -> Vec<LayerGroupRows> {
    rows(&ri.page_table, tables, excluded).expect("rows")
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

/// The fragments of a plan as tuples.
pub fn frags(plan: &kvferry_planner_abi::TransferPlan) -> Vec<(u64, u64, u64)> {
    plan.iter().collect()
}
