//! Models from their Hugging Face `config.json`: the fields a KV cache's shape depends on,
//! read for the architectures kvferry knows, so `check`, `plan`, `demo` and `bench` answer
//! for the model an operator runs, not only for the four presets.
//!
//! | `model_type` | cache |
//! |---|---|
//! | `llama`, `mistral`, `qwen2`, `qwen3` | K/V per layer, `num_key_value_heads` × `head_dim`; sliding-window layers from `layer_types`, Mistral's `sliding_window` or Qwen's `use_sliding_window` |
//! | `phi3` | the same, every layer sliding when the config sets `sliding_window` (Phi-3-medium-4k: 2047) |
//! | `gpt_oss` | the same, sliding on even layers unless `layer_types` says otherwise |
//! | `gemma2` | the same, sliding on even layers unless `layer_types` says otherwise; `head_dim` and `num_key_value_heads` required |
//! | `gemma3_text`, `gemma3` (`text_config`) | the same, global on the layers `i` with `(i + 1) % sliding_window_pattern == 0` (default 6: 5 local : 1 global) and sliding on the rest, or as `layer_types` lists them; `head_dim` and `num_key_value_heads` required |
//! | `qwen2_5_vl` (text fields at the top or in `text_config`) | as `qwen2` |
//! | `llama4_text`, `llama4` (`text_config`) | K/V; the RoPE layers (`no_rope_layers[i]` 1, default: all but every 4th) are chunked-local over `attention_chunk_size` tokens, read as a sliding window of that many tokens (below), the others full |
//! | `deepseek_v2`, `deepseek_v3` | MLA latent, `kv_lora_rank + qk_rope_head_dim` per token |
//! | `qwen3_next` | K/V on every `full_attention_interval`-th layer, Gated DeltaNet state (`linear_*`) on the rest |
//! | `jamba` | K/V on layers `i % attn_layer_period == attn_layer_offset`, Mamba-1 state on the rest: `mamba_expand × hidden_size` channels, `mamba_d_state`, `mamba_d_conv` |
//! | `nemotron_h` | one layer per `hybrid_override_pattern` character (or `layers_block_type` entry): `*` K/V, `M` Mamba-2 state (`mamba_num_heads` × `mamba_head_dim`, `n_groups`, `ssm_state_size`, `conv_kernel`), `-` and `E` (MLP, MoE) nothing |
//!
//! A config with a `text_config` object (a multimodal model: Gemma-3, Qwen2.5-VL, Llama-4) is
//! read from it, its kind from its own `model_type` or, without one, from the outer one
//! (`gemma3` → `gemma3_text`, `qwen2_5_vl` → `qwen2_5_vl_text`, `llama4` → `llama4_text`); the
//! architecture stays the outer config's (`Gemma3ForConditionalGeneration`).
//!
//! `head_dim` defaults to `hidden_size / num_attention_heads` and `num_key_value_heads` to
//! `num_attention_heads`, as in `transformers`, for the families whose config classes default
//! them so; where a class defaults them to fixed numbers instead (Gemma, Qwen2.5-VL, Llama-4,
//! Jamba, Nemotron-H) the config must give them. The KV dtype defaults to the config's
//! `torch_dtype` (or `dtype`); a command's `--dtype` overrides it.
//!
//! Llama-4's chunked attention keeps the tokens of the current `attention_chunk_size` chunk,
//! never more than that many; a sliding window of `attention_chunk_size` tokens covers them
//! (the chunk starts at or after the window does), so the transfer moves every byte such a
//! layer keeps, and at most one chunk and one block more.
//!
//! Mamba state is sized as vLLM's `MambaStateShapeCalculator` sizes it, the conv state in
//! the model's dtype; the SSM state in it too for Jamba, in `mamba_ssm_cache_dtype` (default
//! FP32, vLLM's `NemotronHForCausalLMConfig`) for Nemotron-H.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::layout::{
    Attention, Dtype, LayerKind, LinearAttention, MambaState, ModelShape, alternating_sliding,
    every_nth_full,
};

/// The `model_type`s [`ModelShape::from_hf_config`] reads, and the architecture each defaults to
/// when the config has no `architectures`.
pub const KNOWN_MODEL_TYPES: &[(&str, &str)] = &[
    ("llama", "LlamaForCausalLM"),
    ("mistral", "MistralForCausalLM"),
    ("qwen2", "Qwen2ForCausalLM"),
    ("qwen3", "Qwen3ForCausalLM"),
    ("phi3", "Phi3ForCausalLM"),
    ("gpt_oss", "GptOssForCausalLM"),
    ("gemma2", "Gemma2ForCausalLM"),
    ("gemma3_text", "Gemma3ForCausalLM"),
    ("gemma3", "Gemma3ForConditionalGeneration"),
    ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    ("llama4_text", "Llama4ForCausalLM"),
    ("llama4", "Llama4ForConditionalGeneration"),
    ("deepseek_v2", "DeepseekV2ForCausalLM"),
    ("deepseek_v3", "DeepseekV3ForCausalLM"),
    ("qwen3_next", "Qwen3NextForCausalLM"),
    ("jamba", "JambaForCausalLM"),
    ("nemotron_h", "NemotronHForCausalLM"),
];

/// Where the refusal of an unknown `model_type` sends its reader: how to describe a cache by
/// hand.
pub const DESCRIBE_BY_HAND: &str = "describe its cache by hand instead, as the `rank.page_table` \
     of an agent's configuration (host/capi/README.md, section \"The configuration (JSON or \
     TOML, version 1)\")";

/// Why a `config.json` gives no model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not a JSON object.
    #[error("{what} is not a JSON object: {reason}")]
    Json {
        /// The file (or `config`).
        what: String,
        /// Why.
        reason: String,
    },
    /// A field the shape needs is missing, or null.
    #[error("`{0}` is missing")]
    Missing(String),
    /// A field has the wrong type or an impossible value.
    #[error("`{field}` {reason}")]
    Invalid {
        /// The field.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An architecture this module does not read.
    #[error(
        "model_type `{0}` is not one kvferry knows the cache of (known: {known}); {DESCRIBE_BY_HAND}",
        known = KNOWN_MODEL_TYPES.iter().map(|(t, _)| *t).collect::<Vec<_>>().join(", ")
    )]
    UnknownModelType(String),
}

/// How the cache of a text model's layers is read: one per family of `model_type`s.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Phi3,
    GptOss,
    Gemma2,
    Gemma3,
    Llama4,
    DeepSeek,
    Qwen3Next,
    Jamba,
    NemotronH,
}

/// The family of a text model's `model_type` (a multimodal config's text part included).
fn family(text_type: &str) -> Option<Family> {
    Some(match text_type {
        "llama" => Family::Llama,
        "mistral" => Family::Mistral,
        "qwen2" | "qwen2_5_vl_text" => Family::Qwen2,
        "qwen3" => Family::Qwen3,
        "phi3" => Family::Phi3,
        "gpt_oss" => Family::GptOss,
        "gemma2" => Family::Gemma2,
        "gemma3_text" => Family::Gemma3,
        "llama4_text" => Family::Llama4,
        "deepseek_v2" | "deepseek_v3" => Family::DeepSeek,
        "qwen3_next" => Family::Qwen3Next,
        "jamba" => Family::Jamba,
        "nemotron_h" => Family::NemotronH,
        _ => return None,
    })
}

/// The `model_type` of a multimodal config's text part when the part does not name its own.
fn text_type_of(model_type: &str) -> &str {
    match model_type {
        "gemma3" => "gemma3_text",
        "qwen2_5_vl" => "qwen2_5_vl_text",
        "llama4" => "llama4_text",
        other => other,
    }
}

impl ModelShape {
    /// The model of the `config.json` at `path` (or in the folder `path`), named by the path
    /// as given.
    ///
    /// # Errors
    ///
    /// The file cannot be read, is not JSON, or [`ModelShape::from_hf_config`] refuses it; the
    /// error names the file.
    pub fn from_config_file(path: &Path) -> Result<ModelShape, ConfigError> {
        let file = if path.is_dir() {
            path.join("config.json")
        } else {
            path.to_path_buf()
        };
        let text = std::fs::read_to_string(&file).map_err(|source| ConfigError::Read {
            path: file.clone(),
            source,
        })?;
        ModelShape::from_hf_config(&text, &path.display().to_string())
    }

    /// The model a Hugging Face `config.json`'s text describes, named `name`.
    ///
    /// # Errors
    ///
    /// Not a JSON object, an unknown `model_type` (the message lists the known ones and says
    /// how to describe a cache by hand), or a field the cache's shape needs missing or
    /// impossible (each named).
    pub fn from_hf_config(text: &str, name: &str) -> Result<ModelShape, ConfigError> {
        let value: Value = serde_json::from_str(text).map_err(|e| ConfigError::Json {
            what: name.to_string(),
            reason: e.to_string(),
        })?;
        let Value::Object(config) = value else {
            return Err(ConfigError::Json {
                what: name.to_string(),
                reason: "it is not an object".to_string(),
            });
        };
        let outer = Fields(&config);
        let model_type = outer.string("model_type")?;
        let Some(&(_, default_architecture)) =
            KNOWN_MODEL_TYPES.iter().find(|(t, _)| *t == model_type)
        else {
            return Err(ConfigError::UnknownModelType(model_type));
        };
        let architecture = match config.get("architectures") {
            Some(Value::Array(a)) if !a.is_empty() => match &a[0] {
                Value::String(s) => s.clone(),
                _ => return Err(outer.invalid("architectures", "is not a list of names")),
            },
            _ => default_architecture.to_string(),
        };
        // The text part: `text_config` when there is one (its fields, not the outer ones,
        // size the cache, as `transformers` builds the text config from it), else the config.
        let (c, text_type) = match config.get("text_config") {
            None | Some(Value::Null) => (Fields(&config), text_type_of(&model_type).to_string()),
            Some(Value::Object(part)) => {
                let part = Fields(part);
                let text_type = match part.0.get("model_type") {
                    None | Some(Value::Null) => text_type_of(&model_type).to_string(),
                    Some(Value::String(s)) => s.clone(),
                    Some(_) => {
                        return Err(outer.invalid("text_config.model_type", "is not a string"));
                    }
                };
                (part, text_type)
            }
            Some(_) => return Err(outer.invalid("text_config", "is not an object")),
        };
        let Some(family) = family(&text_type) else {
            return Err(outer.invalid(
                "text_config.model_type",
                &format!(
                    "is `{text_type}`, a text model kvferry does not know the cache of; \
                     {DESCRIBE_BY_HAND}"
                ),
            ));
        };
        let num_layers = match c.optional_positive("num_hidden_layers")? {
            Some(n) => n,
            // `transformers` 5 writes Nemotron-H without it: its layer list is the count.
            None if family == Family::NemotronH => hybrid_pattern_len(&c)?,
            None => return Err(ConfigError::Missing("num_hidden_layers".to_string())),
        };
        let default_dtype = match dtype(&c)? {
            Some(d) => d,
            None => dtype(&outer)?.unwrap_or(Dtype::Bf16),
        };
        let mut sliding_window = None;
        let mut linear = None;
        let mut mamba = None;
        let (attention, layers) = match family {
            Family::DeepSeek => {
                let dim = c
                    .positive("kv_lora_rank")?
                    .checked_add(c.positive("qk_rope_head_dim")?)
                    .ok_or_else(|| c.invalid("kv_lora_rank", "is too large"))?;
                (
                    Attention::Latent { dim },
                    vec![LayerKind::Full; num_layers as usize],
                )
            }
            Family::Qwen3Next => {
                let layers = match c.layer_types(num_layers, false)? {
                    Some(layers) => layers,
                    None => {
                        every_nth_full(num_layers, c.positive_or("full_attention_interval", 4)?)
                    }
                };
                linear = Some(LinearAttention {
                    key_heads: c.positive("linear_num_key_heads")?,
                    value_heads: c.positive("linear_num_value_heads")?,
                    key_head_dim: c.positive("linear_key_head_dim")?,
                    value_head_dim: c.positive("linear_value_head_dim")?,
                    conv_kernel: c.positive("linear_conv_kernel_dim")?,
                });
                (heads(&c, Defaults::Transformers, None)?, layers)
            }
            Family::Llama4 => {
                // vLLM's Llama4Attention: a layer with RoPE (`no_rope_layers[i]` not 0) is
                // chunked-local when the config sets `attention_chunk_size`.
                let chunk = c.optional_positive("attention_chunk_size")?;
                let layers = match c.layer_types(num_layers, true)? {
                    Some(layers) => layers,
                    None => no_rope_layers(&c, num_layers)?
                        .into_iter()
                        .map(|rope| {
                            if rope && chunk.is_some() {
                                LayerKind::Sliding
                            } else {
                                LayerKind::Full
                            }
                        })
                        .collect(),
                };
                if layers.contains(&LayerKind::Sliding) {
                    sliding_window = Some(c.positive("attention_chunk_size")?);
                }
                (heads(&c, Defaults::KvRequired, None)?, layers)
            }
            Family::Jamba => {
                let period = c.positive("attn_layer_period")?;
                let offset = c.count("attn_layer_offset")?;
                if offset >= period {
                    return Err(c.invalid(
                        "attn_layer_offset",
                        &format!("({offset}) is not below attn_layer_period ({period})"),
                    ));
                }
                let layers = (0..num_layers)
                    .map(|l| {
                        if l % period == offset {
                            LayerKind::Full
                        } else {
                            LayerKind::Mamba
                        }
                    })
                    .collect();
                let channels = c
                    .positive("mamba_expand")?
                    .checked_mul(c.positive("hidden_size")?)
                    .ok_or_else(|| c.invalid("mamba_expand", "× hidden_size is too large"))?;
                mamba = Some(MambaState {
                    heads: channels,
                    head_dim: 1,
                    groups: 0,
                    state_size: c.positive("mamba_d_state")?,
                    conv_kernel: c.positive("mamba_d_conv")?,
                    conv_dtype: default_dtype,
                    ssm_dtype: default_dtype,
                });
                (heads(&c, Defaults::KvRequired, None)?, layers)
            }
            Family::NemotronH => {
                let layers = hybrid_pattern(&c, num_layers)?;
                let ssm_dtype = match c.0.get("mamba_ssm_cache_dtype") {
                    None | Some(Value::Null) => Dtype::Fp32,
                    Some(Value::String(s)) => dtype_named(&c, "mamba_ssm_cache_dtype", s)?,
                    Some(_) => return Err(c.invalid("mamba_ssm_cache_dtype", "is not a string")),
                };
                mamba = Some(MambaState {
                    heads: c.positive("mamba_num_heads")?,
                    head_dim: c.positive("mamba_head_dim")?,
                    groups: c.positive_of(&["n_groups", "mamba_n_groups"])?,
                    state_size: c.positive("ssm_state_size")?,
                    conv_kernel: c.positive_of(&["conv_kernel", "mamba_d_conv"])?,
                    conv_dtype: default_dtype,
                    ssm_dtype,
                });
                // Its attention layers' head size: `head_dim`, or the NVIDIA configs'
                // `attention_head_dim`.
                let head_dim = match c.optional_positive("head_dim")? {
                    Some(d) => Some(d),
                    None => c.optional_positive("attention_head_dim")?,
                };
                (heads(&c, Defaults::KvRequired, head_dim)?, layers)
            }
            Family::Gemma2 | Family::Gemma3 => {
                let layers = match c.layer_types(num_layers, false)? {
                    Some(layers) => layers,
                    None if family == Family::Gemma2 => alternating_sliding(num_layers),
                    None => {
                        // Gemma3TextConfig: `sliding_window_pattern` (default 6), layer `i`
                        // global when `(i + 1) % pattern == 0`.
                        let pattern = c.positive_or("sliding_window_pattern", 6)?;
                        (0..num_layers)
                            .map(|l| {
                                if (l + 1) % pattern == 0 {
                                    LayerKind::Full
                                } else {
                                    LayerKind::Sliding
                                }
                            })
                            .collect()
                    }
                };
                (heads(&c, Defaults::Explicit, None)?, layers)
            }
            Family::Llama
            | Family::Mistral
            | Family::Qwen2
            | Family::Qwen3
            | Family::Phi3
            | Family::GptOss => {
                let layers = match c.layer_types(num_layers, false)? {
                    Some(layers) => layers,
                    None => default_layer_types(&c, family, num_layers)?,
                };
                // Qwen2.5-VL's text config defaults its KV heads to 8, not to the attention
                // heads.
                let defaults = if text_type == "qwen2_5_vl_text" {
                    Defaults::KvRequired
                } else {
                    Defaults::Transformers
                };
                (heads(&c, defaults, None)?, layers)
            }
        };
        if layers.contains(&LayerKind::Sliding) && sliding_window.is_none() {
            sliding_window = Some(c.positive("sliding_window")?);
        }
        if layers.contains(&LayerKind::Linear) && linear.is_none() {
            return Err(c.invalid(
                "layer_types",
                &format!("has linear_attention layers, which {text_type} does not"),
            ));
        }
        Ok(ModelShape {
            name: name.to_string(),
            architecture,
            preset: None,
            layers,
            attention,
            sliding_window,
            linear,
            mamba,
            default_dtype,
        })
    }
}

/// How a family's `transformers` config class fills in an absent attention shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Defaults {
    /// `num_key_value_heads` from `num_attention_heads`, `head_dim` from `hidden_size /
    /// num_attention_heads`.
    Transformers,
    /// `head_dim` as above, `num_key_value_heads` required: the class defaults it to a fixed
    /// count (Qwen2.5-VL, Llama-4, Jamba and Nemotron-H: 8), not to the model's heads.
    KvRequired,
    /// Both required: Gemma's classes default `head_dim` to 256 and the KV heads to 4.
    Explicit,
}

/// K/V heads: `num_key_value_heads` (else, where `defaults` allow, `num_attention_heads`) of
/// `head_dim` (else `head_dim`'s field, else, where allowed, `hidden_size /
/// num_attention_heads`).
fn heads(
    c: &Fields<'_>,
    defaults: Defaults,
    head_dim: Option<u32>,
) -> Result<Attention, ConfigError> {
    let attention_heads = c.positive("num_attention_heads")?;
    let kv_heads = match defaults {
        Defaults::Transformers => c.positive_or("num_key_value_heads", attention_heads)?,
        Defaults::KvRequired | Defaults::Explicit => c.positive("num_key_value_heads")?,
    };
    let head_dim = match (head_dim, c.optional_positive("head_dim")?) {
        (Some(d), _) | (None, Some(d)) => d,
        (None, None) if defaults == Defaults::Explicit => {
            return Err(ConfigError::Missing("head_dim".to_string()));
        }
        (None, None) => {
            let hidden = c.positive("hidden_size")?;
            if hidden % attention_heads != 0 {
                return Err(c.invalid(
                    "hidden_size",
                    &format!(
                        "({hidden}) is not a multiple of num_attention_heads ({attention_heads})"
                    ),
                ));
            }
            hidden / attention_heads
        }
    };
    Ok(Attention::Heads { kv_heads, head_dim })
}

/// The layer kinds of a config without `layer_types`, as `transformers` derives them.
fn default_layer_types(
    c: &Fields<'_>,
    family: Family,
    layers: u32,
) -> Result<Vec<LayerKind>, ConfigError> {
    let window = c.optional_positive("sliding_window")?;
    Ok(match family {
        // Every layer slides when the config sets a window (Mistral 7B v0.1: 4096; Phi-3's
        // attention passes its `sliding_window` on every layer).
        Family::Mistral | Family::Phi3 if window.is_some() => {
            vec![LayerKind::Sliding; layers as usize]
        }
        // Sliding from `max_window_layers` on, and only with `use_sliding_window`.
        Family::Qwen2 | Family::Qwen3 if c.flag("use_sliding_window")? && window.is_some() => {
            let from = c.positive_or("max_window_layers", layers)?;
            (0..layers)
                .map(|l| {
                    if l >= from {
                        LayerKind::Sliding
                    } else {
                        LayerKind::Full
                    }
                })
                .collect()
        }
        Family::GptOss => alternating_sliding(layers),
        _ => vec![LayerKind::Full; layers as usize],
    })
}

/// Llama-4's RoPE layers, one flag per layer: `no_rope_layers` (1: RoPE, 0: NoPE), or, when
/// absent or empty, `transformers`' default: RoPE but on every `no_rope_layer_interval`-th
/// layer (default 4).
fn no_rope_layers(c: &Fields<'_>, layers: u32) -> Result<Vec<bool>, ConfigError> {
    let list = match c.0.get("no_rope_layers") {
        None | Some(Value::Null) => None,
        Some(Value::Array(a)) if a.is_empty() => None,
        Some(Value::Array(a)) => Some(a),
        Some(_) => return Err(c.invalid("no_rope_layers", "is not a list")),
    };
    let Some(list) = list else {
        let interval = c.positive_or("no_rope_layer_interval", 4)?;
        return Ok((0..layers).map(|l| (l + 1) % interval != 0).collect());
    };
    if list.len() != layers as usize {
        return Err(c.invalid(
            "no_rope_layers",
            &format!("lists {} layers, num_hidden_layers is {layers}", list.len()),
        ));
    }
    list.iter()
        .enumerate()
        .map(|(i, v)| match v.as_u64() {
            Some(n) => Ok(n != 0),
            None => Err(c.invalid("no_rope_layers", &format!("[{i}] is {v}, not 0 or 1"))),
        })
        .collect()
}

/// How many layers Nemotron-H's layer list ([`hybrid_pattern`]) names, for a config without
/// `num_hidden_layers`.
fn hybrid_pattern_len(c: &Fields<'_>) -> Result<u32, ConfigError> {
    let count = ["layers_block_type", "layer_types"]
        .iter()
        .find_map(|f| c.0.get(*f).and_then(Value::as_array).map(Vec::len))
        .or_else(|| {
            c.0.get("hybrid_override_pattern")
                .and_then(Value::as_str)
                .map(|p| p.chars().count())
        });
    match count.map(u32::try_from) {
        Some(Ok(n)) if n > 0 => Ok(n),
        Some(_) => Err(c.invalid("hybrid_override_pattern", "names no layers")),
        None => Err(ConfigError::Missing("num_hidden_layers".to_string())),
    }
}

/// Nemotron-H's layers: `layers_block_type` (or its alias `layer_types`) when the config lists
/// them, as `transformers` 5 writes them (`full_attention`, `linear_attention` for Mamba-2,
/// `mlp`, `moe`, or the older `attention` and `mamba`), else one per `hybrid_override_pattern`
/// character (`*`, `M`, `-`, `E`); `transformers`' `NemotronHConfig` takes the list first too.
fn hybrid_pattern(c: &Fields<'_>, layers: u32) -> Result<Vec<LayerKind>, ConfigError> {
    for field in ["layers_block_type", "layer_types"] {
        let list = match c.0.get(field) {
            None | Some(Value::Null) => continue,
            Some(Value::Array(a)) => a,
            Some(_) => return Err(c.invalid(field, "is not a list")),
        };
        if list.len() != layers as usize {
            return Err(c.invalid(
                field,
                &format!("lists {} layers, num_hidden_layers is {layers}", list.len()),
            ));
        }
        return list
            .iter()
            .enumerate()
            .map(|(i, kind)| match kind.as_str() {
                Some("full_attention" | "attention") => Ok(LayerKind::Full),
                Some("linear_attention" | "mamba") => Ok(LayerKind::Mamba),
                Some("mlp" | "moe") => Ok(LayerKind::NoCache),
                _ => Err(c.invalid(
                    field,
                    &format!(
                        "[{i}] is {kind}; known: full_attention (or attention), \
                         linear_attention (or mamba), mlp, moe"
                    ),
                )),
            })
            .collect();
    }
    let pattern = c.string("hybrid_override_pattern")?;
    let count = pattern.chars().count();
    if count != layers as usize {
        return Err(c.invalid(
            "hybrid_override_pattern",
            &format!("has {count} layers, num_hidden_layers is {layers}"),
        ));
    }
    pattern
        .chars()
        .enumerate()
        .map(|(i, ch)| match ch {
            '*' => Ok(LayerKind::Full),
            'M' => Ok(LayerKind::Mamba),
            '-' | 'E' => Ok(LayerKind::NoCache),
            other => Err(c.invalid(
                "hybrid_override_pattern",
                &format!(
                    "[{i}] is `{other}`; known: `*` (attention), `M` (Mamba-2), `-` (MLP), \
                     `E` (MoE)"
                ),
            )),
        })
        .collect()
}

/// The dtype the config's weights are in: `torch_dtype` (or `dtype`), if it names one.
fn dtype(c: &Fields<'_>) -> Result<Option<Dtype>, ConfigError> {
    match (c.0.get("torch_dtype"), c.0.get("dtype")) {
        (Some(Value::String(s)), _) => dtype_named(c, "torch_dtype", s).map(Some),
        (_, Some(Value::String(s))) => dtype_named(c, "dtype", s).map(Some),
        _ => Ok(None),
    }
}

/// The dtype a `torch` dtype name in `field` names.
fn dtype_named(c: &Fields<'_>, field: &str, value: &str) -> Result<Dtype, ConfigError> {
    match value {
        "bfloat16" => Ok(Dtype::Bf16),
        "float16" => Ok(Dtype::Fp16),
        "float32" => Ok(Dtype::Fp32),
        other => Err(c.invalid(
            field,
            &format!("is `{other}`; known: bfloat16, float16, float32 (or pass --dtype)"),
        )),
    }
}

/// A config's fields, read with errors that name them.
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn invalid(&self, field: &str, reason: &str) -> ConfigError {
        ConfigError::Invalid {
            field: field.to_string(),
            reason: reason.to_string(),
        }
    }

    fn string(&self, field: &str) -> Result<String, ConfigError> {
        match self.0.get(field) {
            None | Some(Value::Null) => Err(ConfigError::Missing(field.to_string())),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(_) => Err(self.invalid(field, "is not a string")),
        }
    }

    /// A count, 0 allowed, if the field is there.
    fn optional_count(&self, field: &str) -> Result<Option<u32>, ConfigError> {
        match self.0.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_u64().and_then(|n| u32::try_from(n).ok()) {
                Some(n) => Ok(Some(n)),
                None => Err(self.invalid(field, &format!("is {v}, not a count"))),
            },
        }
    }

    /// A count, 0 allowed.
    fn count(&self, field: &str) -> Result<u32, ConfigError> {
        self.optional_count(field)?
            .ok_or_else(|| ConfigError::Missing(field.to_string()))
    }

    fn optional_positive(&self, field: &str) -> Result<Option<u32>, ConfigError> {
        match self.optional_count(field)? {
            Some(0) => Err(self.invalid(field, "is 0")),
            n => Ok(n),
        }
    }

    fn positive(&self, field: &str) -> Result<u32, ConfigError> {
        self.optional_positive(field)?
            .ok_or_else(|| ConfigError::Missing(field.to_string()))
    }

    /// The first of `fields` the config has (the spellings one value goes by), the first
    /// named when none is there.
    fn positive_of(&self, fields: &[&str]) -> Result<u32, ConfigError> {
        for field in fields {
            if let Some(n) = self.optional_positive(field)? {
                return Ok(n);
            }
        }
        Err(ConfigError::Missing(fields.join("` (or `")))
    }

    fn positive_or(&self, field: &str, default: u32) -> Result<u32, ConfigError> {
        Ok(self.optional_positive(field)?.unwrap_or(default))
    }

    fn flag(&self, field: &str) -> Result<bool, ConfigError> {
        match self.0.get(field) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(self.invalid(field, "is not true or false")),
        }
    }

    /// `layer_types`, when the config lists them: one per layer. `chunked`: Llama-4's kinds,
    /// `chunked_attention` (read as sliding over the chunk) and `full_attention`; else
    /// `full_attention`, `sliding_attention` and `linear_attention`.
    fn layer_types(
        &self,
        layers: u32,
        chunked: bool,
    ) -> Result<Option<Vec<LayerKind>>, ConfigError> {
        let list = match self.0.get("layer_types") {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::Array(a)) => a,
            Some(_) => return Err(self.invalid("layer_types", "is not a list")),
        };
        if list.len() != layers as usize {
            return Err(self.invalid(
                "layer_types",
                &format!("lists {} layers, num_hidden_layers is {layers}", list.len()),
            ));
        }
        let known: &[(&str, LayerKind)] = if chunked {
            &[
                ("full_attention", LayerKind::Full),
                ("chunked_attention", LayerKind::Sliding),
            ]
        } else {
            &[
                ("full_attention", LayerKind::Full),
                ("sliding_attention", LayerKind::Sliding),
                ("linear_attention", LayerKind::Linear),
            ]
        };
        list.iter()
            .enumerate()
            .map(|(i, kind)| {
                known
                    .iter()
                    .find(|(name, _)| kind.as_str() == Some(name))
                    .map(|&(_, k)| k)
                    .ok_or_else(|| {
                        self.invalid(
                            "layer_types",
                            &format!(
                                "[{i}] is {kind}; known: {}",
                                known.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
                            ),
                        )
                    })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }
}
