//! ModelShape presets and the per-rank cache layout they produce.
//!
//! [`build_instance`] turns a [`ModelSpec`] and a parallel [`Mapping`] into one [`RankInfo`]
//! per rank of an instance, with the page table that rank would advertise: pools, layer
//! groups, views, buffer entries and shard geometry (`transfer-semantics.md` §2, §12). The
//! dimensions are the published ones of each model; nothing here is tuned for a planner.
//!
//! | preset | layers | groups |
//! |---|---|---|
//! | `deepseek-v3` | 61 | PAGED MLA latent `{key}`, 576 elements/token/layer, duplicated over TP |
//! | `llama-3-70b` | 80 | PAGED `{key,value}` HND, 8 KV heads × 128 |
//! | `qwen3-next-80b-a3b` | 48 | PAGED `{key,value}` (every 4th layer, 2 KV heads × 256) + STATE `conv` (SECTIONED Q/K/V) and `ssm` (HND fp32) |
//! | `gpt-oss-120b` | 36 | PAGED sliding (even layers, window 128) + PAGED full (odd layers), 8 KV heads × 64 |
//!
//! Every view gets its own pool; a slot holds the group's layers back to back, each layer's
//! buffers (K then V) back to back ([`crate::builder::page_table`]). Layer ids are stage-local
//! (`local`) and model-wide (`global = first layer of the stage + local`).

use std::fmt;

use kvferry_planner_abi::ffi::{RString, RVec};
use kvferry_planner_abi::{
    GroupKind, LayoutKind, LocalLayer, Mapping, PlanError, RankInfo, RoleLayout,
};
use strum::VariantNames;

pub use crate::builder::PoolOptions;
use crate::builder::{GroupSpec, ViewSpec, page_table, rank_info};

/// Why a layout could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// A preset name no preset answers to.
    #[error("unknown model preset `{0}` (known: {known})", known = Preset::VARIANTS.join(", "))]
    UnknownPreset(String),
    /// A dtype name other than `fp8`, `bf16`, `fp16` or `fp32`.
    #[error("unknown kv dtype `{0}` (known: {known})", known = Dtype::VARIANTS.join(", "))]
    UnknownDtype(String),
    /// A mapping with a zero size.
    #[error("mapping {mapping}: {what} must be at least 1")]
    ZeroSize {
        /// The mapping.
        mapping: Mapping,
        /// Which size is zero.
        what: &'static str,
    },
    /// `tokens_per_block` is zero.
    #[error("tokens_per_block must be at least 1")]
    ZeroTokensPerBlock,
    /// An explicit PP split that does not fit the model or the mapping.
    #[error("layers_per_pp {split:?} does not fit: {reason}")]
    LayerSplit {
        /// The split asked for.
        split: Vec<u32>,
        /// What is wrong with it.
        reason: String,
    },
    /// A TP width the model's heads or channels cannot be split over.
    #[error(
        "{model}: {what} ({count}) cannot be split over {width} ranks: the width must divide \
         the count or be a multiple of it"
    )]
    Sharding {
        /// The model's name ([`ModelShape::name`]).
        model: String,
        /// What is being split, e.g. `kv heads`.
        what: &'static str,
        /// How many there are.
        count: u32,
        /// The width asked for.
        width: u32,
    },
    /// An instance rank outside the mapping.
    #[error("instance rank {rank} is outside mapping {mapping} ({world} ranks)")]
    RankOutOfRange {
        /// The rank asked for.
        rank: u32,
        /// The mapping.
        mapping: Mapping,
        /// Ranks in the mapping.
        world: u32,
    },
    /// An instance of more ranks than [`MAX_INSTANCE_RANKS`] (every rank would be laid out,
    /// and `tp × pp × cp` may not even fit the ABI's `u32`).
    #[error(
        "deployment {mapping} has {world} ranks (tp {tp} × pp {pp} × cp {cp}): the largest \
         instance supported has {MAX_INSTANCE_RANKS}",
        world = ranks_of(mapping),
        tp = mapping.tp,
        pp = mapping.pp,
        cp = mapping.cp
    )]
    TooManyRanks {
        /// The mapping.
        mapping: Mapping,
    },
    /// A rank whose pools would hold more than [`MAX_RANK_BYTES`] (boxed: its `u128` would
    /// widen every error that holds a `LayoutError`).
    #[error(transparent)]
    RankTooLarge(Box<RankTooLarge>),
    /// The built page table failed its structural check (a bug in this module).
    #[error("page table of rank {rank} is invalid")]
    InvalidPageTable {
        /// The rank.
        rank: u32,
        /// The check that failed.
        source: PlanError,
    },
}

/// The most ranks an instance may have: far more GPUs than one serving instance runs, and
/// every rank of one is laid out (`check` and `plan` build all of them, a few KiB each), so a
/// wider mapping is refused before the first rank is.
pub const MAX_INSTANCE_RANKS: u32 = 65_536;

/// The most bytes the pools of one rank may take: 64 TiB, more than any machine's memory
/// (host or device) and half of x86-64's 128 TiB user address space, so a rank past it can
/// never be allocated, and sums over the ranks of an instance stay far from `u64::MAX`.
pub const MAX_RANK_BYTES: u64 = 1 << 46;

/// The exact count and its size in binary units ([`crate::units::bytes`]), as the transfer
/// library's host budget prints them.
pub fn bytes_text(n: u128) -> String {
    match u64::try_from(n) {
        Ok(n) => crate::units::bytes(n),
        Err(_) => format!("{n} bytes (more than 16 EiB)"),
    }
}

/// A rank whose pools would hold more than [`MAX_RANK_BYTES`]: what it would take.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{instance} rank {rank} ({mapping}): its pools would take {} ({slots} PAGED slots per \
     pool, the largest slot {slot_bytes} bytes); one rank may hold at most 64 TiB \
     ({MAX_RANK_BYTES} bytes), more than any machine's memory",
    bytes_text(*bytes)
)]
pub struct RankTooLarge {
    /// The instance's name.
    pub instance: String,
    /// The rank.
    pub rank: u32,
    /// The mapping.
    pub mapping: Mapping,
    /// Bytes of all its pools (`u128`: they may pass `u64`).
    pub bytes: u128,
    /// PAGED slots per pool.
    pub slots: u64,
    /// Bytes of its largest slot (`u64::MAX` past it).
    pub slot_bytes: u64,
}

/// A model whose cache layout kvferry knows, by its command-line name (e.g. `deepseek-v3`).
/// `Preset::iter()` ([`strum::IntoEnumIterator`]) yields every preset in documentation order.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    strum::AsRefStr,
    strum::Display,
    strum::EnumIter,
    strum::EnumString,
    strum::VariantNames,
)]
#[strum(parse_err_ty = LayoutError, parse_err_fn = unknown_preset)]
pub enum Preset {
    /// DeepSeek-V3 / R1: MLA latent cache, 61 layers.
    #[strum(serialize = "deepseek-v3")]
    DeepseekV3,
    /// Llama-3-70B: GQA, 80 layers, 8 KV heads of 128.
    #[strum(serialize = "llama-3-70b")]
    Llama3_70b,
    /// Qwen3-Next-80B-A3B: 12 full-attention layers and 36 Gated DeltaNet layers.
    #[strum(serialize = "qwen3-next-80b-a3b")]
    Qwen3Next80bA3b,
    /// gpt-oss-120b: 36 layers alternating sliding-window (128) and full attention.
    #[strum(serialize = "gpt-oss-120b")]
    GptOss120b,
}

impl Preset {
    /// Every preset's command-line name, in documentation order.
    pub fn names() -> &'static [&'static str] {
        Self::VARIANTS
    }
}

fn unknown_preset(name: &str) -> LayoutError {
    LayoutError::UnknownPreset(name.to_string())
}

impl Preset {
    /// The architecture name of the model's config, as a [`kvferry_planner_abi::Deployment`]
    /// carries it.
    pub fn architecture(self) -> &'static str {
        match self {
            Preset::DeepseekV3 => "DeepseekV3ForCausalLM",
            Preset::Llama3_70b => "LlamaForCausalLM",
            Preset::Qwen3Next80bA3b => "Qwen3NextForCausalLM",
            Preset::GptOss120b => "GptOssForCausalLM",
        }
    }

    /// Decoder layers of the model.
    pub fn num_layers(self) -> u32 {
        match self {
            Preset::DeepseekV3 => 61,
            Preset::Llama3_70b => 80,
            Preset::Qwen3Next80bA3b => 48,
            Preset::GptOss120b => 36,
        }
    }

    /// The KV dtype served by default: FP8 for DeepSeek, BF16 otherwise.
    pub fn default_dtype(self) -> Dtype {
        match self {
            Preset::DeepseekV3 => Dtype::Fp8,
            _ => Dtype::Bf16,
        }
    }

    /// The model's cache shape, with its published dimensions.
    pub fn model(self) -> ModelShape {
        let n = self.num_layers();
        let (attention, layers, sliding_window, linear) = match self {
            // One latent "head" of kv_lora_rank 512 + rope 64, duplicated on every TP rank.
            Preset::DeepseekV3 => (
                Attention::Latent { dim: 576 },
                vec![LayerKind::Full; n as usize],
                None,
                None,
            ),
            Preset::Llama3_70b => (
                Attention::Heads {
                    kv_heads: 8,
                    head_dim: 128,
                },
                vec![LayerKind::Full; n as usize],
                None,
                None,
            ),
            // Full attention on every 4th layer, Gated DeltaNet on the rest: 16 key heads and
            // 32 value heads of 128, conv kernel 4.
            Preset::Qwen3Next80bA3b => (
                Attention::Heads {
                    kv_heads: 2,
                    head_dim: 256,
                },
                every_nth_full(n, 4),
                None,
                Some(LinearAttention {
                    key_heads: 16,
                    value_heads: 32,
                    key_head_dim: 128,
                    value_head_dim: 128,
                    conv_kernel: 4,
                }),
            ),
            // Sliding window (128) on even layers, full attention on odd ones.
            Preset::GptOss120b => (
                Attention::Heads {
                    kv_heads: 8,
                    head_dim: 64,
                },
                alternating_sliding(n),
                Some(128),
                None,
            ),
        };
        ModelShape {
            name: self.to_string(),
            architecture: self.architecture().to_string(),
            preset: Some(self),
            layers,
            attention,
            sliding_window,
            linear,
            mamba: None,
            default_dtype: self.default_dtype(),
        }
    }
}

/// Full attention on the last layer of every run of `interval` (Qwen3-Next's
/// `full_attention_interval`), linear attention on the others.
pub(crate) fn every_nth_full(layers: u32, interval: u32) -> Vec<LayerKind> {
    (0..layers)
        .map(|l| {
            if (l + 1) % interval == 0 {
                LayerKind::Full
            } else {
                LayerKind::Linear
            }
        })
        .collect()
}

/// Sliding-window attention on even layers, full attention on odd ones (gpt-oss).
pub(crate) fn alternating_sliding(layers: u32) -> Vec<LayerKind> {
    (0..layers)
        .map(|l| {
            if l % 2 == 0 {
                LayerKind::Sliding
            } else {
                LayerKind::Full
            }
        })
        .collect()
}

/// What one decoder layer keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// Attention over the whole prompt.
    Full,
    /// Attention over the last [`ModelShape::sliding_window`] tokens.
    Sliding,
    /// Linear attention (Gated DeltaNet): recurrent state, no per-token cache.
    Linear,
    /// A Mamba layer (Jamba, Nemotron-H): recurrent conv and SSM state ([`ModelShape::mamba`]),
    /// no per-token cache.
    Mamba,
    /// A layer that keeps nothing between steps: an MLP or MoE block of a hybrid stack
    /// (Nemotron-H's `-` and `E`). It counts in the layer numbering and the PP split, and
    /// belongs to no group.
    NoCache,
}

/// The attention cache of a model's attention layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Attention {
    /// K and V per layer: `kv_heads` heads of `head_dim` elements per token (GQA and MHA),
    /// split over TP by head.
    Heads {
        /// Key/value heads.
        kv_heads: u32,
        /// Elements per head and token.
        head_dim: u32,
    },
    /// One latent vector of `dim` elements per token (MLA: `kv_lora_rank +
    /// qk_rope_head_dim`), the same on every TP rank.
    Latent {
        /// Elements per token.
        dim: u32,
    },
}

/// Gated DeltaNet's recurrent state per linear-attention layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LinearAttention {
    /// Key heads (queries have as many).
    pub key_heads: u32,
    /// Value heads.
    pub value_heads: u32,
    /// Elements per key head.
    pub key_head_dim: u32,
    /// Elements per value head.
    pub value_head_dim: u32,
    /// The short convolution's kernel (its state keeps `kernel - 1` steps).
    pub conv_kernel: u32,
}

/// A Mamba layer's recurrent state per sequence, as vLLM's `MambaStateShapeCalculator` sizes it
/// (`vllm/model_executor/layers/mamba/mamba_utils.py`): the short convolution's last
/// `conv_kernel - 1` inputs over `heads × head_dim` channels of x (Mamba-2 adds `groups ×
/// state_size` channels each of B and C), and the SSM state, `head_dim × state_size` per head.
///
/// Mamba-2 (Nemotron-H) reads as named. Mamba-1 (Jamba) is the case `head_dim` 1, `groups` 0:
/// its `d_inner` channels are each a "head" of one channel, so the conv state is
/// `d_inner × (conv_kernel - 1)` and the SSM state `d_inner × state_size`, vLLM's
/// `mamba1_state_shape`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MambaState {
    /// SSM heads (Mamba-2 `mamba_num_heads`; Mamba-1: the `d_inner` channels).
    pub heads: u32,
    /// Channels per head (Mamba-2 `mamba_head_dim`; 1 for Mamba-1).
    pub head_dim: u32,
    /// Groups of B and C (Mamba-2 `n_groups`); 0 for Mamba-1, whose convolution runs over x
    /// alone.
    pub groups: u32,
    /// SSM state size per channel (`ssm_state_size`, Jamba's `mamba_d_state`).
    pub state_size: u32,
    /// The short convolution's kernel (its state keeps `kernel - 1` steps).
    pub conv_kernel: u32,
    /// Element type of the conv state (vLLM: the model's dtype).
    pub conv_dtype: Dtype,
    /// Element type of the SSM state.
    pub ssm_dtype: Dtype,
}

/// A model's KV-cache shape: everything a rank's layout depends on besides the deployment,
/// from a [`Preset`] or from the model's Hugging Face `config.json`
/// ([`ModelShape::from_hf_config`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelShape {
    /// What messages call it, and what `--model` takes to name it again: the preset's name,
    /// or the config file's path.
    pub name: String,
    /// The architecture a [`kvferry_planner_abi::Deployment`] carries (`LlamaForCausalLM`).
    pub architecture: String,
    /// The preset it is, if it is one.
    pub preset: Option<Preset>,
    /// Each decoder layer's kind, in order.
    pub layers: Vec<LayerKind>,
    /// The attention layers' cache.
    pub attention: Attention,
    /// Tokens a [`LayerKind::Sliding`] layer keeps.
    pub sliding_window: Option<u32>,
    /// The [`LayerKind::Linear`] layers' state.
    pub linear: Option<LinearAttention>,
    /// The [`LayerKind::Mamba`] layers' state.
    pub mamba: Option<MambaState>,
    /// The KV dtype it is served with unless told otherwise.
    pub default_dtype: Dtype,
}

impl ModelShape {
    /// Decoder layers.
    pub fn num_layers(&self) -> u32 {
        self.layers.len() as u32
    }
}

/// Element type of the attention KV cache: `fp8`, `bf16`, `fp16` or `fp32` on the command line.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    strum::AsRefStr,
    strum::Display,
    strum::EnumString,
    strum::VariantNames,
)]
#[strum(
    serialize_all = "lowercase",
    parse_err_ty = LayoutError,
    parse_err_fn = unknown_dtype
)]
pub enum Dtype {
    /// FP8 E4M3, one byte.
    Fp8,
    /// BF16, two bytes.
    Bf16,
    /// FP16, two bytes.
    Fp16,
    /// FP32, four bytes (vLLM's `--dtype float32`, the tiny test models).
    Fp32,
}

fn unknown_dtype(name: &str) -> LayoutError {
    LayoutError::UnknownDtype(name.to_string())
}

impl Dtype {
    /// The name a [`RoleLayout`] carries: `fp8_e4m3`, `bf16`, `fp16` or `fp32`.
    pub fn layout_name(self) -> &'static str {
        match self {
            Dtype::Fp8 => "fp8_e4m3",
            Dtype::Bf16 => "bf16",
            Dtype::Fp16 => "fp16",
            Dtype::Fp32 => "fp32",
        }
    }

    /// Bits per element.
    pub fn bits(self) -> u32 {
        match self {
            Dtype::Fp8 => 8,
            Dtype::Bf16 | Dtype::Fp16 => 16,
            Dtype::Fp32 => 32,
        }
    }

    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        u64::from(self.bits() / 8)
    }
}

/// A model as served: preset, KV dtype, block size and (optionally) an uneven PP split.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelSpec {
    /// The model.
    pub model: ModelShape,
    /// Element type of the attention KV cache (recurrent state keeps its own types).
    pub dtype: Dtype,
    /// Tokens per PAGED slot.
    pub tokens_per_block: u32,
    /// An explicit layer split for deployments with exactly `split.len()` PP stages; other
    /// PP sizes (and `None`) split evenly, earlier stages taking the remainder. One spec can
    /// so describe both sides of a pair whose PP sizes differ.
    pub layers_per_pp: Option<Vec<u32>>,
    /// Each layer in a group, view and pool of its own, as vLLM and SGLang keep one tensor
    /// per layer (what layer-wise sends split by), instead of a slot holding every layer of
    /// its group (TensorRT-LLM's block).
    pub pool_per_layer: bool,
}

impl ModelSpec {
    /// The preset with its default dtype, 32 tokens per block and an even PP split.
    pub fn new(preset: Preset) -> Self {
        Self::of(preset.model())
    }

    /// The model with its default dtype, 32 tokens per block and an even PP split.
    pub fn of(model: ModelShape) -> Self {
        Self {
            dtype: model.default_dtype,
            model,
            tokens_per_block: 32,
            layers_per_pp: None,
            pool_per_layer: false,
        }
    }

    /// The architecture a [`kvferry_planner_abi::Deployment`] carries.
    pub fn architecture(&self) -> &str {
        &self.model.architecture
    }

    /// The model's name ([`ModelShape::name`]).
    pub fn name(&self) -> &str {
        &self.model.name
    }

    /// Decoder layers of the model.
    pub fn num_layers(&self) -> u32 {
        self.model.num_layers()
    }

    /// The same spec with each layer in a pool of its own.
    pub fn with_pool_per_layer(mut self) -> Self {
        self.pool_per_layer = true;
        self
    }

    /// The same spec with another dtype.
    pub fn with_dtype(mut self, dtype: Dtype) -> Self {
        self.dtype = dtype;
        self
    }

    /// The same spec with another block size.
    pub fn with_tokens_per_block(mut self, tokens_per_block: u32) -> Self {
        self.tokens_per_block = tokens_per_block;
        self
    }

    /// The same spec with an explicit split for `split.len()` PP stages.
    pub fn with_layers_per_pp(mut self, split: Vec<u32>) -> Self {
        self.layers_per_pp = Some(split);
        self
    }

    /// Layers held by each of `pp` stages.
    ///
    /// # Errors
    ///
    /// `pp` of 0, or an explicit split for `pp` stages whose sum is not the model's layer
    /// count.
    pub fn layers_per_pp(&self, pp: u32) -> Result<Vec<u32>, LayoutError> {
        let total = self.model.num_layers();
        match self
            .layers_per_pp
            .as_ref()
            .filter(|s| s.len() == pp as usize)
        {
            Some(split) => {
                let fail = |reason: String| LayoutError::LayerSplit {
                    split: split.clone(),
                    reason,
                };
                let sum: u64 = split.iter().map(|&n| u64::from(n)).sum();
                if sum != u64::from(total) {
                    return Err(fail(format!(
                        "sums to {sum}, {} has {total} layers",
                        self.model.name
                    )));
                }
                Ok(split.clone())
            }
            None => {
                if pp == 0 {
                    return Err(LayoutError::LayerSplit {
                        split: Vec::new(),
                        reason: "pp is 0".to_string(),
                    });
                }
                let (base, extra) = (total / pp, total % pp);
                Ok((0..pp).map(|p| base + u32::from(p < extra)).collect())
            }
        }
    }
}

impl fmt::Display for ModelSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} tpb{}",
            self.model.name, self.dtype, self.tokens_per_block
        )
    }
}

/// One [`RankInfo`] per rank of an instance, in rank order.
///
/// `alloc(rank, pool, bytes)` is called once per pool of every rank with the pool's
/// footprint ([`PhysicalPool::footprint`]) and returns the pool's base address.
///
/// [`PhysicalPool::footprint`]: kvferry_planner_abi::PhysicalPool::footprint
///
/// # Errors
///
/// See [`build_rank`].
pub fn build_instance(
    model: &ModelSpec,
    mapping: &Mapping,
    instance_name: &str,
    planner_id: &str,
    options: &PoolOptions,
    alloc: &mut dyn FnMut(u32, usize, u64) -> u64,
) -> Result<Vec<RankInfo>, LayoutError> {
    let world = check_mapping(mapping)?;
    (0..world)
        .map(|rank| {
            build_rank(
                model,
                mapping,
                instance_name,
                planner_id,
                rank,
                options,
                alloc,
            )
        })
        .collect()
}

/// The [`RankInfo`] of one rank of an instance.
///
/// # Errors
///
/// A zero size in the mapping or a zero block size, more than [`MAX_INSTANCE_RANKS`] ranks,
/// a PP split that does not fit, a TP width the model's heads cannot be split over (e.g.
/// Llama's 8 KV heads over 3 ranks), pools of more than [`MAX_RANK_BYTES`], or a rank
/// outside the mapping.
pub fn build_rank(
    model: &ModelSpec,
    mapping: &Mapping,
    instance_name: &str,
    planner_id: &str,
    rank: u32,
    options: &PoolOptions,
    alloc: &mut dyn FnMut(u32, usize, u64) -> u64,
) -> Result<RankInfo, LayoutError> {
    let world = check_mapping(mapping)?;
    if model.tokens_per_block == 0 {
        return Err(LayoutError::ZeroTokensPerBlock);
    }
    if rank >= world {
        return Err(LayoutError::RankOutOfRange {
            rank,
            mapping: *mapping,
            world,
        });
    }
    let coords = mapping.coords(rank);
    let layers_per_pp = model.layers_per_pp(mapping.pp)?;
    let stage_start: u32 = layers_per_pp[..coords.pp as usize].iter().sum();
    let stage = Stage {
        start: stage_start,
        len: layers_per_pp[coords.pp as usize],
    };
    // TP width of one DP group, and this rank's place in it.
    let (tp_per_dp, tp_in_dp) = if mapping.attention_dp {
        (1, 0)
    } else {
        (mapping.tp, coords.tp)
    };
    let geometry = Geometry {
        tpb: u64::from(model.tokens_per_block),
        elem: model.dtype,
        tp_per_dp,
        tp_in_dp,
        // Recurrent state under helix: CP ranks act as TP, CP-minor (semantics §6.2).
        state_width: tp_per_dp * mapping.cp,
        state_index: tp_in_dp * mapping.cp + coords.cp,
    };
    let groups = groups(&model.model, &geometry, &stage)?;
    let groups = if model.pool_per_layer {
        groups
            .into_iter()
            .flat_map(|g| {
                g.layers
                    .iter()
                    .map(|&layer| GroupSpec {
                        layers: vec![layer],
                        ..g.clone()
                    })
                    .collect::<Vec<_>>()
            })
            .collect()
    } else {
        groups
    };
    let bytes = crate::builder::pools_bytes(&groups, options);
    if bytes > u128::from(MAX_RANK_BYTES) {
        return Err(LayoutError::RankTooLarge(Box::new(RankTooLarge {
            instance: instance_name.to_string(),
            rank,
            mapping: *mapping,
            bytes,
            slots: options.paged_slots,
            slot_bytes: crate::builder::largest_slot(&groups),
        })));
    }
    let page_table = page_table(
        model.tokens_per_block,
        groups,
        options,
        &mut |pool, bytes| alloc(rank, pool, bytes),
    );
    page_table
        .validate()
        .map_err(|source| LayoutError::InvalidPageTable { rank, source })?;
    Ok(rank_info(
        instance_name,
        mapping,
        rank,
        layers_per_pp,
        page_table,
        planner_id,
    ))
}

/// The ranks of `mapping` (`tp × pp × cp`), once every size is at least 1 and the product
/// at most [`MAX_INSTANCE_RANKS`]: what [`build_instance`] and [`build_rank`] check first,
/// and what a caller that sizes anything by the rank count (a server's rank list) checks
/// before it does.
///
/// # Errors
///
/// [`LayoutError::ZeroSize`] or [`LayoutError::TooManyRanks`].
pub fn check_mapping(mapping: &Mapping) -> Result<u32, LayoutError> {
    for (what, size) in [("tp", mapping.tp), ("pp", mapping.pp), ("cp", mapping.cp)] {
        if size == 0 {
            return Err(LayoutError::ZeroSize {
                mapping: *mapping,
                what,
            });
        }
    }
    match u32::try_from(ranks_of(mapping)) {
        Ok(w) if w <= MAX_INSTANCE_RANKS => Ok(w),
        _ => Err(LayoutError::TooManyRanks { mapping: *mapping }),
    }
}

/// `tp × pp × cp`, exact (`u128`: three `u32` sizes can pass `u64`).
fn ranks_of(mapping: &Mapping) -> u128 {
    [mapping.tp, mapping.pp, mapping.cp]
        .iter()
        .map(|&n| u128::from(n))
        .product()
}

/// The layers one PP stage holds: global ids `start .. start + len`.
struct Stage {
    start: u32,
    len: u32,
}

impl Stage {
    /// The stage's layers whose global id satisfies `keep`, as (local, global).
    fn layers(&self, keep: impl Fn(u32) -> bool) -> Vec<LocalLayer> {
        (0..self.len)
            .map(|local| LocalLayer {
                local,
                global: self.start + local,
            })
            .filter(|l| keep(l.global))
            .collect()
    }
}

/// What a rank's layout depends on besides the model.
struct Geometry {
    tpb: u64,
    elem: Dtype,
    /// Attention TP width inside the DP group (1 under attention DP).
    tp_per_dp: u32,
    /// TP rank inside the DP group.
    tp_in_dp: u32,
    /// Width of the recurrent-state shard grid (TP × CP).
    state_width: u32,
    /// This rank's index in that grid.
    state_index: u32,
}

/// How a set of heads is spread over a TP width.
struct HeadSplit {
    heads_per_rank: u32,
    num_shards: u32,
    shard_index: u32,
    num_replicas: u32,
    replica_index: u32,
}

fn split_heads(
    model: &ModelShape,
    what: &'static str,
    heads: u32,
    width: u32,
    index: u32,
) -> Result<HeadSplit, LayoutError> {
    if heads == 0 || (heads % width != 0 && width % heads != 0) {
        return Err(LayoutError::Sharding {
            model: model.name.clone(),
            what,
            count: heads,
            width,
        });
    }
    let num_shards = width.min(heads);
    let num_replicas = width / num_shards;
    Ok(HeadSplit {
        heads_per_rank: (heads / width).max(1),
        num_shards,
        shard_index: index / num_replicas,
        num_replicas,
        replica_index: index % num_replicas,
    })
}

/// A K/V (or K-only) attention view, HND, sharded by head.
fn attention_view(roles: &[&str], split: &HeadSplit, head_dim: u64, g: &Geometry) -> ViewSpec {
    let unit = g.tpb * head_dim * g.elem.bytes();
    ViewSpec {
        roles: roles.iter().map(|r| (*r).to_string()).collect(),
        layout: RoleLayout {
            kind: LayoutKind::HND,
            dtype: RString::from(g.elem.layout_name()),
            elem_bits: g.elem.bits(),
            num_shards: split.num_shards,
            shard_index: split.shard_index,
            num_replicas: split.num_replicas,
            replica_index: split.replica_index,
            shard_unit_bytes: unit,
            section_bytes: RVec::new(),
        },
        buffers: roles.len() as u32,
        buffer_bytes: u64::from(split.heads_per_rank) * unit,
    }
}

const KV: &[&str] = &["key", "value"];

/// The layer groups of one PP stage of `model`: the sliding-window attention layers, then the
/// full-attention ones (each a PAGED group, when the stage has any), then the linear-attention
/// layers' recurrent state and the Mamba layers' (each a STATE group). [`LayerKind::NoCache`]
/// layers are in none.
fn groups(model: &ModelShape, g: &Geometry, stage: &Stage) -> Result<Vec<GroupSpec>, LayoutError> {
    let kind_of = |global: u32| model.layers[global as usize];
    let view = match model.attention {
        Attention::Heads { kv_heads, head_dim } => {
            let split = split_heads(model, "kv heads", kv_heads, g.tp_per_dp, g.tp_in_dp)?;
            attention_view(KV, &split, u64::from(head_dim), g)
        }
        Attention::Latent { dim } => {
            let split = split_heads(model, "mla latent heads", 1, g.tp_per_dp, g.tp_in_dp)?;
            attention_view(&["key"], &split, u64::from(dim), g)
        }
    };
    let mut groups = Vec::new();
    for (kind, window) in [
        (LayerKind::Sliding, model.sliding_window),
        (LayerKind::Full, None),
    ] {
        // A kind the model has gets its group on every stage, even one holding none of
        // its layers, so every rank of an instance has the same groups.
        if model.layers.contains(&kind) {
            let layers = stage.layers(|l| kind_of(l) == kind);
            groups.push(GroupSpec {
                kind: GroupKind::PAGED,
                window: window.map(u64::from),
                layers,
                views: vec![view.clone()],
            });
        }
    }
    if let (true, Some(spec)) = (model.layers.contains(&LayerKind::Linear), model.linear) {
        groups.push(GroupSpec {
            kind: GroupKind::STATE,
            window: None,
            layers: stage.layers(|l| kind_of(l) == LayerKind::Linear),
            views: linear_state(model, &spec, g)?,
        });
    }
    if let (true, Some(spec)) = (model.layers.contains(&LayerKind::Mamba), model.mamba) {
        groups.push(GroupSpec {
            kind: GroupKind::STATE,
            window: None,
            layers: stage.layers(|l| kind_of(l) == LayerKind::Mamba),
            views: mamba_state(model, &spec, g)?,
        });
    }
    Ok(groups)
}

/// A Mamba layer's state views: `conv` (the convolution's last `kernel - 1` inputs,
/// channel-major `[channel][step]`, sectioned x | B | C, or x alone for Mamba-1, so a shard of
/// each section is one run of channels) and `ssm` (`head_dim × state_size` per head, HND),
/// both sharded over TP × CP by head and group as vLLM shards them. vLLM replicates B and C
/// groups when a TP width does not divide them; that is not described here, such a width is
/// refused.
fn mamba_state(
    model: &ModelShape,
    spec: &MambaState,
    g: &Geometry,
) -> Result<Vec<ViewSpec>, LayoutError> {
    let mut counts = vec![(
        if spec.groups == 0 {
            "mamba channels"
        } else {
            "mamba heads"
        },
        spec.heads,
    )];
    if spec.groups > 0 {
        counts.push(("mamba groups", spec.groups));
    }
    check_state_shards(model, g.state_width, &counts)?;
    let x = u64::from(spec.heads) * u64::from(spec.head_dim);
    let b_c = u64::from(spec.groups) * u64::from(spec.state_size);
    let channels: &[u64] = if spec.groups == 0 {
        &[x]
    } else {
        &[x, b_c, b_c]
    };
    let ssm_head = u64::from(spec.head_dim) * u64::from(spec.state_size) * spec.ssm_dtype.bytes();
    Ok(state_views(
        g,
        (spec.conv_dtype, spec.conv_kernel, channels),
        (spec.ssm_dtype, spec.heads, ssm_head),
    ))
}

/// Gated DeltaNet's state views: `conv` (the short convolution's last `kernel - 1` inputs,
/// BF16, channel-major `[channel][step]`, sectioned Q | K | V so a shard of each section is one
/// run of channels) and `ssm` (one `key_head_dim × value_head_dim` FP32 matrix per value head,
/// HND), both sharded over TP × CP.
fn linear_state(
    model: &ModelShape,
    spec: &LinearAttention,
    g: &Geometry,
) -> Result<Vec<ViewSpec>, LayoutError> {
    check_state_shards(
        model,
        g.state_width,
        &[
            ("gated deltanet key heads", spec.key_heads),
            ("gated deltanet value heads", spec.value_heads),
        ],
    )?;
    let keys = u64::from(spec.key_heads) * u64::from(spec.key_head_dim);
    let values = u64::from(spec.value_heads) * u64::from(spec.value_head_dim);
    let ssm_head = u64::from(spec.key_head_dim) * u64::from(spec.value_head_dim) * 4;
    Ok(state_views(
        g,
        (Dtype::Bf16, spec.conv_kernel, &[keys, keys, values]),
        (Dtype::Fp32, spec.value_heads, ssm_head),
    ))
}

/// Refuses a recurrent state whose `counts` (heads, groups) do not split evenly over the
/// `width` ranks that share it.
fn check_state_shards(
    model: &ModelShape,
    width: u32,
    counts: &[(&'static str, u32)],
) -> Result<(), LayoutError> {
    for &(what, count) in counts {
        if count == 0 || count % width != 0 {
            return Err(LayoutError::Sharding {
                model: model.name.clone(),
                what,
                count,
                width,
            });
        }
    }
    Ok(())
}

/// A recurrent state's two views on this rank, sharded over the state's ranks: `conv`, the
/// short convolution's last `kernel - 1` inputs channel-major in sections of `channels`
/// (each section split over the ranks, so a shard of each is one run of channels), and `ssm`,
/// `heads` matrices of `ssm_head` bytes split by head (HND).
fn state_views(
    g: &Geometry,
    (conv_dtype, conv_kernel, channels): (Dtype, u32, &[u64]),
    (ssm_dtype, heads, ssm_head): (Dtype, u32, u64),
) -> Vec<ViewSpec> {
    let (w, i) = (g.state_width, g.state_index);
    let per_channel = u64::from(conv_kernel.saturating_sub(1)) * conv_dtype.bytes();
    let sections: Vec<u64> = channels
        .iter()
        .map(|c| c / u64::from(w) * per_channel)
        .collect();
    let view =
        |role: &str, kind, dtype: Dtype, shard_unit_bytes, section_bytes: &[u64], bytes| ViewSpec {
            roles: vec![role.to_string()],
            layout: RoleLayout {
                kind,
                dtype: RString::from(dtype.layout_name()),
                elem_bits: dtype.bits(),
                num_shards: w,
                shard_index: i,
                num_replicas: 1,
                replica_index: 0,
                shard_unit_bytes,
                section_bytes: RVec::from(section_bytes.to_vec()),
            },
            buffers: 1,
            buffer_bytes: bytes,
        };
    vec![
        view(
            "conv",
            LayoutKind::SECTIONED,
            conv_dtype,
            0,
            &sections,
            sections.iter().sum(),
        ),
        view(
            "ssm",
            LayoutKind::HND,
            ssm_dtype,
            ssm_head,
            &[],
            u64::from(heads / w) * ssm_head,
        ),
    ]
}
