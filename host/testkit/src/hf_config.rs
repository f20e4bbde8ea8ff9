//! Models from their Hugging Face `config.json`: the fields a KV cache's shape depends on,
//! read for the architectures kvferry knows, so `check`, `plan`, `demo` and `bench` answer
//! for the model an operator runs, not only for the four presets.
//!
//! | `model_type` | cache |
//! |---|---|
//! | `llama`, `mistral`, `qwen2`, `qwen3` | K/V per layer, `num_key_value_heads` × `head_dim`; sliding-window layers from `layer_types`, Mistral's `sliding_window` or Qwen's `use_sliding_window` |
//! | `gpt_oss` | the same, sliding on even layers unless `layer_types` says otherwise |
//! | `deepseek_v2`, `deepseek_v3` | MLA latent, `kv_lora_rank + qk_rope_head_dim` per token |
//! | `qwen3_next` | K/V on every `full_attention_interval`-th layer, Gated DeltaNet state (`linear_*`) on the rest |
//!
//! `head_dim` defaults to `hidden_size / num_attention_heads` and `num_key_value_heads` to
//! `num_attention_heads`, as in `transformers`. The KV dtype defaults to the config's
//! `torch_dtype` (or `dtype`); a command's `--dtype` overrides it.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::layout::{
    Attention, Dtype, LayerKind, LinearAttention, ModelShape, alternating_sliding, every_nth_full,
};

/// The `model_type`s [`ModelShape::from_hf_config`] reads, and the architecture each defaults to
/// when the config has no `architectures`.
pub const KNOWN_MODEL_TYPES: &[(&str, &str)] = &[
    ("llama", "LlamaForCausalLM"),
    ("mistral", "MistralForCausalLM"),
    ("qwen2", "Qwen2ForCausalLM"),
    ("qwen3", "Qwen3ForCausalLM"),
    ("gpt_oss", "GptOssForCausalLM"),
    ("deepseek_v2", "DeepseekV2ForCausalLM"),
    ("deepseek_v3", "DeepseekV3ForCausalLM"),
    ("qwen3_next", "Qwen3NextForCausalLM"),
];

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
        "model_type `{0}` is not one kvferry knows the cache of (known: {known})",
        known = KNOWN_MODEL_TYPES.iter().map(|(t, _)| *t).collect::<Vec<_>>().join(", ")
    )]
    UnknownModelType(String),
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
    /// Not a JSON object, an unknown `model_type`, or a field the cache's shape needs
    /// missing or impossible (each named).
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
        let c = Fields(&config);
        let model_type = c.string("model_type")?;
        let Some(&(_, default_architecture)) =
            KNOWN_MODEL_TYPES.iter().find(|(t, _)| *t == model_type)
        else {
            return Err(ConfigError::UnknownModelType(model_type));
        };
        let architecture = match config.get("architectures") {
            Some(Value::Array(a)) if !a.is_empty() => match &a[0] {
                Value::String(s) => s.clone(),
                _ => return Err(c.invalid("architectures", "is not a list of names")),
            },
            _ => default_architecture.to_string(),
        };
        let num_layers = c.positive("num_hidden_layers")?;
        let default_dtype = dtype(&c)?;
        let mut sliding_window = None;
        let mut linear = None;
        let (attention, layers) = match model_type.as_str() {
            "deepseek_v2" | "deepseek_v3" => {
                let dim = c
                    .positive("kv_lora_rank")?
                    .checked_add(c.positive("qk_rope_head_dim")?)
                    .ok_or_else(|| c.invalid("kv_lora_rank", "is too large"))?;
                (
                    Attention::Latent { dim },
                    vec![LayerKind::Full; num_layers as usize],
                )
            }
            "qwen3_next" => {
                let layers = match c.layer_types(num_layers)? {
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
                (heads(&c)?, layers)
            }
            _ => {
                let layers = match c.layer_types(num_layers)? {
                    Some(layers) => layers,
                    None => default_layer_types(&c, &model_type, num_layers)?,
                };
                (heads(&c)?, layers)
            }
        };
        if layers.contains(&LayerKind::Sliding) {
            sliding_window = Some(c.positive("sliding_window")?);
        }
        if layers.contains(&LayerKind::Linear) && linear.is_none() {
            return Err(c.invalid(
                "layer_types",
                &format!("has linear_attention layers, which {model_type} does not"),
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
            default_dtype,
        })
    }
}

/// K/V heads: `num_key_value_heads` (else `num_attention_heads`) of `head_dim` (else
/// `hidden_size / num_attention_heads`).
fn heads(c: &Fields<'_>) -> Result<Attention, ConfigError> {
    let attention_heads = c.positive("num_attention_heads")?;
    let kv_heads = c.positive_or("num_key_value_heads", attention_heads)?;
    let head_dim = match c.optional_positive("head_dim")? {
        Some(d) => d,
        None => {
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
    model_type: &str,
    layers: u32,
) -> Result<Vec<LayerKind>, ConfigError> {
    let window = c.optional_positive("sliding_window")?;
    Ok(match model_type {
        // Every layer slides when the config sets a window (Mistral 7B v0.1: 4096).
        "mistral" if window.is_some() => vec![LayerKind::Sliding; layers as usize],
        // Sliding from `max_window_layers` on, and only with `use_sliding_window`.
        "qwen2" | "qwen3" if c.flag("use_sliding_window")? && window.is_some() => {
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
        "gpt_oss" => alternating_sliding(layers),
        _ => vec![LayerKind::Full; layers as usize],
    })
}

/// The KV dtype the config's weights are in: `torch_dtype` (or `dtype`), BF16 without one.
fn dtype(c: &Fields<'_>) -> Result<Dtype, ConfigError> {
    let (field, value) = match (c.0.get("torch_dtype"), c.0.get("dtype")) {
        (Some(Value::String(s)), _) => ("torch_dtype", s.as_str()),
        (_, Some(Value::String(s))) => ("dtype", s.as_str()),
        _ => return Ok(Dtype::Bf16),
    };
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

    fn optional_positive(&self, field: &str) -> Result<Option<u32>, ConfigError> {
        match self.0.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_u64().and_then(|n| u32::try_from(n).ok()) {
                Some(0) => Err(self.invalid(field, "is 0")),
                Some(n) => Ok(Some(n)),
                None => Err(self.invalid(field, &format!("is {v}, not a count"))),
            },
        }
    }

    fn positive(&self, field: &str) -> Result<u32, ConfigError> {
        self.optional_positive(field)?
            .ok_or_else(|| ConfigError::Missing(field.to_string()))
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

    /// `layer_types`, when the config lists them: one per layer.
    fn layer_types(&self, layers: u32) -> Result<Option<Vec<LayerKind>>, ConfigError> {
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
        list.iter()
            .enumerate()
            .map(|(i, kind)| match kind.as_str() {
                Some("full_attention") => Ok(LayerKind::Full),
                Some("sliding_attention") => Ok(LayerKind::Sliding),
                Some("linear_attention") => Ok(LayerKind::Linear),
                _ => Err(self.invalid(
                    "layer_types",
                    &format!(
                        "[{i}] is {kind}; known: full_attention, sliding_attention, \
                         linear_attention"
                    ),
                )),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }
}
