//! Models from their Hugging Face `config.json` (`tests/fixtures/hf/`): the published models'
//! configs give exactly the presets' layouts, the tiny models the real-model and vLLM checks
//! build give theirs, and what cannot be read is refused by name.

use std::path::{Path, PathBuf};

use kvferry_planner_abi::{GroupKind, LayoutKind, RankInfo, SlotTable};
use kvferry_testkit::hf_config::{ConfigError, DESCRIBE_BY_HAND, KNOWN_MODEL_TYPES};
use kvferry_testkit::layout::{
    Attention, Dtype, LayerKind, LayoutError, LinearAttention, MambaState, ModelShape, ModelSpec,
    Preset,
};
use kvferry_testkit::scenario::{SlotAssignment, slot_tables};

use crate::layout_presets::{build, mapping};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

fn load(name: &str) -> ModelShape {
    ModelShape::from_config_file(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Everything but the name and the preset it is.
fn same_shape(a: &ModelShape, b: &ModelShape) {
    assert_eq!(a.architecture, b.architecture);
    assert_eq!(a.layers, b.layers);
    assert_eq!(a.attention, b.attention);
    assert_eq!(a.sliding_window, b.sliding_window);
    assert_eq!(a.linear, b.linear);
}

#[test]
fn the_published_configs_give_the_presets_layouts() {
    for (file, preset, deployments) in [
        (
            "llama-3-70b.json",
            Preset::Llama3_70b,
            vec![
                mapping(1, 1, 1, false),
                mapping(4, 1, 1, false),
                mapping(8, 2, 1, false),
            ],
        ),
        (
            "deepseek-v3.json",
            Preset::DeepseekV3,
            vec![
                mapping(4, 1, 1, true),
                mapping(8, 1, 1, false),
                mapping(2, 1, 4, false),
            ],
        ),
        (
            "qwen3-next-80b-a3b.json",
            Preset::Qwen3Next80bA3b,
            vec![
                mapping(1, 1, 1, false),
                mapping(4, 2, 1, false),
                mapping(2, 1, 2, false),
            ],
        ),
        (
            "gpt-oss-120b.json",
            Preset::GptOss120b,
            vec![
                mapping(1, 1, 1, false),
                mapping(8, 1, 1, false),
                mapping(2, 4, 1, false),
            ],
        ),
    ] {
        let from = load(file);
        assert_eq!(from.preset, None);
        assert_eq!(from.name, fixture(file).display().to_string());
        assert_eq!(
            from.default_dtype,
            Dtype::Bf16,
            "{file}: torch_dtype bfloat16"
        );
        same_shape(&from, &preset.model());
        for m in deployments {
            let ours = build(&ModelSpec::of(from.clone()).with_dtype(Dtype::Bf16), m).unwrap();
            let want = build(&ModelSpec::new(preset).with_dtype(Dtype::Bf16), m).unwrap();
            assert_eq!(ours, want, "{file} {m}");
        }
    }
}

#[test]
fn the_real_model_checks_tiny_configs_give_their_shapes() {
    let llama = load("tiny-llama.json");
    assert_eq!(llama.architecture, "LlamaForCausalLM");
    assert_eq!(llama.layers, vec![LayerKind::Full; 4]);
    assert_eq!(
        llama.attention,
        Attention::Heads {
            kv_heads: 4,
            head_dim: 32
        }
    );
    // No dtype in the file: BF16.
    assert_eq!(llama.default_dtype, Dtype::Bf16);

    let next = load("tiny-qwen3-next.json");
    assert_eq!(next.architecture, "Qwen3NextForCausalLM");
    assert_eq!(
        next.layers,
        [
            LayerKind::Linear,
            LayerKind::Full,
            LayerKind::Linear,
            LayerKind::Full
        ]
    );
    assert_eq!(
        next.linear,
        Some(LinearAttention {
            key_heads: 4,
            value_heads: 8,
            key_head_dim: 32,
            value_head_dim: 32,
            conv_kernel: 4,
        })
    );
    let ranks = build(&ModelSpec::of(next), mapping(2, 1, 1, false)).unwrap();
    let kinds: Vec<GroupKind> = ranks[0].page_table.groups.iter().map(|g| g.kind).collect();
    assert_eq!(kinds, [GroupKind::PAGED, GroupKind::STATE]);

    let oss = load("tiny-gpt-oss.json");
    assert_eq!(oss.sliding_window, Some(16));
    assert_eq!(
        oss.layers,
        [
            LayerKind::Sliding,
            LayerKind::Full,
            LayerKind::Sliding,
            LayerKind::Full
        ]
    );
    let ranks = build(&ModelSpec::of(oss), mapping(4, 1, 1, false)).unwrap();
    let windows: Vec<Option<u64>> = ranks[0]
        .page_table
        .groups
        .iter()
        .map(|g| g.window.into())
        .collect();
    assert_eq!(windows, [Some(16), None]);
}

#[test]
fn the_vllm_checks_tiny_configs_give_float32_caches() {
    for (file, layers) in [("vllm-tiny-llama.json", 4), ("vllm-tiny-qwen3.json", 3)] {
        let m = load(file);
        assert_eq!(m.layers, vec![LayerKind::Full; layers], "{file}");
        assert_eq!(
            m.attention,
            Attention::Heads {
                kv_heads: 2,
                head_dim: 64
            },
            "{file}"
        );
        assert_eq!(m.default_dtype, Dtype::Fp32, "{file}: dtype float32");
        let spec = ModelSpec::of(m);
        // K and V of 2 heads × 64 FP32 elements × 32 tokens per block, per layer.
        let ranks = build(&spec, mapping(1, 1, 1, false)).unwrap();
        assert_eq!(
            ranks[0].page_table.pools[0].slot_bytes,
            2 * 2 * 64 * 4 * 32 * layers as u64
        );
        // Two KV heads split over TP 2, and refused over TP 3.
        build(&spec, mapping(2, 1, 1, false)).unwrap();
        let err = build(&spec, mapping(3, 1, 1, false))
            .unwrap_err()
            .to_string();
        assert!(err.contains("kv heads (2)") && err.contains(file), "{err}");
    }
}

#[test]
fn a_folder_holding_a_config_json_is_read_too() {
    let dir = std::env::temp_dir().join(format!("kvferry-hf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(fixture("llama-3-70b.json"), dir.join("config.json")).unwrap();
    let m = ModelShape::from_config_file(&dir).unwrap();
    assert_eq!(m.num_layers(), 80);
    std::fs::remove_dir_all(&dir).unwrap();
}

fn refused(text: &str) -> String {
    ModelShape::from_hf_config(text, "cfg")
        .expect_err(text)
        .to_string()
}

#[test]
fn what_cannot_be_read_is_refused_by_name() {
    let unknown = refused(r#"{"model_type": "mamba", "num_hidden_layers": 4}"#);
    assert!(
        unknown.contains("model_type `mamba`") && unknown.contains("llama"),
        "{unknown}"
    );
    assert!(refused(r#"{"num_hidden_layers": 4}"#).contains("`model_type` is missing"));
    let no_layers = refused(r#"{"model_type": "llama", "num_attention_heads": 8}"#);
    assert!(
        no_layers.contains("`num_hidden_layers` is missing"),
        "{no_layers}"
    );
    let no_rank = refused(r#"{"model_type": "deepseek_v3", "num_hidden_layers": 2}"#);
    assert!(no_rank.contains("`kv_lora_rank` is missing"), "{no_rank}");
    let uneven = refused(
        r#"{"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 3,
            "hidden_size": 256}"#,
    );
    assert!(uneven.contains("`hidden_size` (256)"), "{uneven}");
    let types = refused(
        r#"{"model_type": "qwen3", "num_hidden_layers": 2, "num_attention_heads": 2,
            "head_dim": 64, "layer_types": ["full_attention"]}"#,
    );
    assert!(
        types.contains("lists 1 layers, num_hidden_layers is 2"),
        "{types}"
    );
    let kind = refused(
        r#"{"model_type": "qwen3", "num_hidden_layers": 1, "num_attention_heads": 2,
            "head_dim": 64, "layer_types": ["chunked_attention"]}"#,
    );
    assert!(kind.contains("[0] is \"chunked_attention\""), "{kind}");
    let window = refused(
        r#"{"model_type": "gpt_oss", "num_hidden_layers": 2, "num_attention_heads": 2,
            "head_dim": 64}"#,
    );
    assert!(window.contains("`sliding_window` is missing"), "{window}");
    let zero = refused(r#"{"model_type": "llama", "num_hidden_layers": 0}"#);
    assert!(zero.contains("`num_hidden_layers` is 0"), "{zero}");
    let dtype = refused(
        r#"{"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 2,
            "head_dim": 64, "torch_dtype": "int4"}"#,
    );
    assert!(dtype.contains("`torch_dtype` is `int4`"), "{dtype}");
    assert!(refused("[1, 2]").contains("not an object"));
    assert!(matches!(
        ModelShape::from_config_file(&fixture("absent.json")),
        Err(ConfigError::Read { .. })
    ));
}

#[test]
fn sliding_windows_follow_transformers_defaults() {
    // Mistral 7B v0.1: every layer slides over 4096 tokens.
    let mistral = ModelShape::from_hf_config(
        r#"{"model_type": "mistral", "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "hidden_size": 4096, "sliding_window": 4096}"#,
        "mistral",
    )
    .unwrap();
    assert_eq!(mistral.layers, vec![LayerKind::Sliding; 32]);
    assert_eq!(mistral.sliding_window, Some(4096));
    assert_eq!(mistral.architecture, "MistralForCausalLM");
    // Qwen2 slides from max_window_layers on, and only with use_sliding_window.
    let qwen = |use_sliding: bool| {
        ModelShape::from_hf_config(
            &format!(
                r#"{{"model_type": "qwen2", "num_hidden_layers": 4, "num_attention_heads": 4,
                    "hidden_size": 256, "sliding_window": 64, "max_window_layers": 2,
                    "use_sliding_window": {use_sliding}}}"#
            ),
            "qwen2",
        )
        .unwrap()
        .layers
    };
    assert_eq!(qwen(false), vec![LayerKind::Full; 4]);
    assert_eq!(
        qwen(true),
        [
            LayerKind::Full,
            LayerKind::Full,
            LayerKind::Sliding,
            LayerKind::Sliding
        ]
    );
}

/// The layers of `model` of `kind`, by model-wide id.
fn layers_of(model: &ModelShape, kind: LayerKind) -> Vec<u32> {
    (0..model.num_layers())
        .filter(|&l| model.layers[l as usize] == kind)
        .collect()
}

fn slot_bytes(info: &RankInfo, pool: u32) -> u64 {
    info.page_table.pools[pool as usize].slot_bytes
}

#[test]
fn gemma_3_27b_slides_on_five_layers_of_six() {
    let m = load("gemma-3-27b.json");
    // The outer config's architecture; the shape from its text_config (gemma3_text).
    assert_eq!(m.architecture, "Gemma3ForConditionalGeneration");
    assert_eq!(m.num_layers(), 62);
    // sliding_window_pattern 6 (the default; the published config does not set it): layer i is
    // global when (i + 1) % 6 == 0.
    assert_eq!(
        layers_of(&m, LayerKind::Full),
        [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]
    );
    assert_eq!(layers_of(&m, LayerKind::Sliding).len(), 52);
    assert_eq!(
        m.attention,
        Attention::Heads {
            kv_heads: 16,
            head_dim: 128
        }
    );
    assert_eq!(m.sliding_window, Some(1024));
    // torch_dtype at the top level, outside text_config.
    assert_eq!(m.default_dtype, Dtype::Bf16);
    let spec = ModelSpec::of(m);
    let tp1 = build(&spec, mapping(1, 1, 1, false)).unwrap();
    let groups = &tp1[0].page_table.groups;
    let windows: Vec<Option<u64>> = groups.iter().map(|g| g.window.into()).collect();
    assert_eq!(windows, [Some(1024), None]);
    assert_eq!(groups[0].layers.len(), 52);
    // K and V of 16 heads × 128 BF16 elements × 32 tokens, per layer.
    assert_eq!(
        slot_bytes(&tp1[0], groups[0].views[0].pool),
        52 * 2 * 16 * 128 * 2 * 32
    );
    // 16 KV heads: TP 16 splits them, TP 32 duplicates them, TP 3 cannot.
    build(&spec, mapping(16, 1, 1, false)).unwrap();
    build(&spec, mapping(32, 1, 1, false)).unwrap();
    assert!(matches!(
        build(&spec, mapping(3, 1, 1, false)),
        Err(LayoutError::Sharding { count: 16, .. })
    ));
}

#[test]
fn gemma_text_configs_follow_their_pattern_or_layer_types() {
    let gemma3 = |extra: &str| {
        ModelShape::from_hf_config(
            &format!(
                r#"{{"model_type": "gemma3_text", "num_hidden_layers": 8,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                    "sliding_window": 512{extra}}}"#
            ),
            "gemma3",
        )
    };
    // A text-only Gemma-3 (Gemma3ForCausalLM) with a pattern of its own.
    let m = gemma3(r#", "sliding_window_pattern": 4"#).unwrap();
    assert_eq!(m.architecture, "Gemma3ForCausalLM");
    assert_eq!(layers_of(&m, LayerKind::Full), [3, 7]);
    // layer_types wins over the pattern.
    let m = gemma3(
        r#", "sliding_window_pattern": 4, "layer_types": ["full_attention", "full_attention",
            "sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention",
            "sliding_attention", "full_attention"]"#,
    )
    .unwrap();
    assert_eq!(layers_of(&m, LayerKind::Full), [0, 1, 7]);
    // Gemma's classes default head_dim to 256 and the KV heads to 4, not to what the other
    // fields imply: a config without them is refused, naming the field.
    let no_dim = ModelShape::from_hf_config(
        r#"{"model_type": "gemma3_text", "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "hidden_size": 256, "sliding_window": 512}"#,
        "cfg",
    )
    .unwrap_err()
    .to_string();
    assert!(no_dim.contains("`head_dim` is missing"), "{no_dim}");
    let no_kv = ModelShape::from_hf_config(
        r#"{"model_type": "gemma2", "num_hidden_layers": 2, "num_attention_heads": 4,
            "head_dim": 64, "sliding_window": 512}"#,
        "cfg",
    )
    .unwrap_err()
    .to_string();
    assert!(
        no_kv.contains("`num_key_value_heads` is missing"),
        "{no_kv}"
    );

    let gemma2 = load("gemma-2-9b.json");
    assert_eq!(gemma2.architecture, "Gemma2ForCausalLM");
    // Sliding on even layers, as Gemma2Config derives layer_types.
    assert_eq!(gemma2.layers, alternating(42));
    assert_eq!(gemma2.sliding_window, Some(4096));
    assert_eq!(
        gemma2.attention,
        Attention::Heads {
            kv_heads: 8,
            head_dim: 256
        }
    );
    // The fixture has no torch_dtype: BF16.
    assert_eq!(gemma2.default_dtype, Dtype::Bf16);
}

/// Sliding on even layers, full on odd ones.
fn alternating(layers: usize) -> Vec<LayerKind> {
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

#[test]
fn phi_3_medium_slides_on_every_layer() {
    let m = load("phi-3-medium-4k-instruct.json");
    assert_eq!(m.architecture, "Phi3ForCausalLM");
    assert_eq!(m.layers, vec![LayerKind::Sliding; 40]);
    assert_eq!(m.sliding_window, Some(2047));
    // 5120 / 40 heads.
    assert_eq!(
        m.attention,
        Attention::Heads {
            kv_heads: 10,
            head_dim: 128
        }
    );
    let spec = ModelSpec::of(m);
    let tp2 = build(&spec, mapping(2, 1, 1, false)).unwrap();
    assert_eq!(tp2[0].page_table.groups.len(), 1);
    assert_eq!(tp2[0].page_table.groups[0].window(), Some(2047));
    // 10 KV heads: TP 4 can neither split nor duplicate them.
    assert!(matches!(
        build(&spec, mapping(4, 1, 1, false)),
        Err(LayoutError::Sharding {
            count: 10,
            width: 4,
            ..
        })
    ));
}

#[test]
fn qwen2_5_vl_reads_its_text_fields_at_the_top_or_in_text_config() {
    // The published config (text fields at the top level) and the same config as
    // transformers 5.23 writes it (under text_config, model_type qwen2_5_vl_text).
    let top = load("qwen2.5-vl-7b-instruct.json");
    let nested = load("qwen2.5-vl-7b-instruct-transformers5.json");
    for m in [&top, &nested] {
        assert_eq!(m.architecture, "Qwen2_5_VLForConditionalGeneration");
        // use_sliding_window false: every layer full.
        assert_eq!(m.layers, vec![LayerKind::Full; 28]);
        assert_eq!(m.sliding_window, None);
        assert_eq!(
            m.attention,
            Attention::Heads {
                kv_heads: 4,
                head_dim: 128
            }
        );
        assert_eq!(m.default_dtype, Dtype::Bf16);
    }
    same_shape(&top, &nested);
    for m in [mapping(1, 1, 1, false), mapping(4, 1, 1, false)] {
        assert_eq!(
            build(&ModelSpec::of(top.clone()), m).unwrap(),
            build(&ModelSpec::of(nested.clone()), m).unwrap()
        );
    }
    // Its text config defaults the KV heads to 8, not to the attention heads: required.
    let no_kv = ModelShape::from_hf_config(
        r#"{"model_type": "qwen2_5_vl", "text_config": {"num_hidden_layers": 2,
            "num_attention_heads": 4, "hidden_size": 256}}"#,
        "cfg",
    )
    .unwrap_err()
    .to_string();
    assert!(
        no_kv.contains("`num_key_value_heads` is missing"),
        "{no_kv}"
    );
    // A text part of a kind kvferry does not know is refused by name.
    let unknown = ModelShape::from_hf_config(
        r#"{"model_type": "llama4", "text_config": {"model_type": "mamba2",
            "num_hidden_layers": 2}}"#,
        "cfg",
    )
    .unwrap_err()
    .to_string();
    assert!(
        unknown.contains("`text_config.model_type` is `mamba2`")
            && unknown.contains(DESCRIBE_BY_HAND),
        "{unknown}"
    );
    let not_object =
        ModelShape::from_hf_config(r#"{"model_type": "gemma3", "text_config": [1]}"#, "cfg")
            .unwrap_err()
            .to_string();
    assert!(
        not_object.contains("`text_config` is not an object"),
        "{not_object}"
    );
}

#[test]
fn llama_4_scout_chunked_layers_are_windows_of_one_chunk() {
    let m = load("llama-4-scout-17b-16e-instruct.json");
    assert_eq!(m.architecture, "Llama4ForConditionalGeneration");
    assert_eq!(m.num_layers(), 48);
    // No no_rope_layers in the file: transformers' default (interval 4) leaves every 4th layer
    // without RoPE, and vLLM makes those full attention, the others chunked-local.
    assert_eq!(
        layers_of(&m, LayerKind::Full),
        [3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47]
    );
    assert_eq!(layers_of(&m, LayerKind::Sliding).len(), 36);
    assert_eq!(m.sliding_window, Some(8192), "attention_chunk_size");
    assert_eq!(
        m.attention,
        Attention::Heads {
            kv_heads: 8,
            head_dim: 128
        }
    );
    // What moves covers what a chunked layer keeps: for every prompt, the blocks of the chunk
    // the next token attends over ([⌊L / C⌋·C, L)) are in the slot tables a decode rank of
    // this layout takes, and at most one chunk and one block of tokens more.
    let spec = ModelSpec::of(m);
    let tpb = u64::from(spec.tokens_per_block);
    let ranks = build(&spec, mapping(8, 1, 1, false)).unwrap();
    let group = ranks[0]
        .page_table
        .groups
        .iter()
        .position(|g| g.window() == Some(8192))
        .unwrap();
    let chunk = 8192u64;
    for prompt in [
        1u64, 31, 32, 33, 8191, 8192, 8193, 8224, 16383, 16384, 20000, 40000,
    ] {
        let blocks = prompt.div_ceil(tpb);
        let tables: Vec<SlotTable> =
            slot_tables(&ranks[0], prompt, 0, &SlotAssignment::contiguous(blocks));
        let held: Vec<u64> = (0..blocks)
            .filter(|&o| tables[group].slots[o as usize] != SlotTable::HOLE)
            .collect();
        let chunk_start = prompt / chunk * chunk;
        for o in chunk_start / tpb..blocks {
            assert!(held.contains(&o), "prompt {prompt}: block {o} of the chunk");
        }
        assert!(
            held.len() as u64 * tpb <= chunk + tpb,
            "prompt {prompt}: {} blocks",
            held.len()
        );
    }

    let scout = |extra: &str| {
        ModelShape::from_hf_config(
            &format!(
                r#"{{"model_type": "llama4_text", "num_hidden_layers": 4,
                    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64{extra}}}"#
            ),
            "llama4",
        )
    };
    // no_rope_layers spelled out.
    let m = scout(r#", "attention_chunk_size": 64, "no_rope_layers": [0, 1, 1, 0]"#).unwrap();
    assert_eq!(
        m.layers,
        [
            LayerKind::Full,
            LayerKind::Sliding,
            LayerKind::Sliding,
            LayerKind::Full
        ]
    );
    assert_eq!(m.sliding_window, Some(64));
    // layer_types as transformers 5 writes them.
    let m = scout(
        r#", "attention_chunk_size": 64, "layer_types": ["chunked_attention",
            "full_attention", "full_attention", "chunked_attention"]"#,
    )
    .unwrap();
    assert_eq!(layers_of(&m, LayerKind::Sliding), [0, 3]);
    // No chunk size: vLLM makes every layer full attention.
    let m = scout(r#", "attention_chunk_size": null"#).unwrap();
    assert_eq!(m.layers, vec![LayerKind::Full; 4]);
    assert_eq!(m.sliding_window, None);
    let wrong = scout(r#", "attention_chunk_size": 64, "no_rope_layers": [1, 1]"#)
        .unwrap_err()
        .to_string();
    assert!(
        wrong.contains("`no_rope_layers` lists 2 layers, num_hidden_layers is 4"),
        "{wrong}"
    );
    let sliding = scout(
        r#", "attention_chunk_size": 64, "layer_types": ["sliding_attention",
            "full_attention", "full_attention", "full_attention"]"#,
    )
    .unwrap_err()
    .to_string();
    assert!(
        sliding.contains("[0] is \"sliding_attention\"; known: full_attention, chunked_attention"),
        "{sliding}"
    );
}

#[test]
fn jamba_1_5_mini_keeps_attention_every_eighth_layer_and_mamba_state_on_the_rest() {
    let m = load("jamba-1.5-mini.json");
    assert_eq!(m.architecture, "JambaForCausalLM");
    // attn_layer_period 8, attn_layer_offset 4.
    assert_eq!(layers_of(&m, LayerKind::Full), [4, 12, 20, 28]);
    assert_eq!(layers_of(&m, LayerKind::Mamba).len(), 28);
    assert_eq!(
        m.attention,
        Attention::Heads {
            kv_heads: 8,
            head_dim: 128
        }
    );
    // Mamba-1: mamba_expand 2 × hidden_size 4096 channels, d_state 16, d_conv 4, both states
    // in the model's BF16 (vLLM's mamba1_state_dtype with its defaults).
    assert_eq!(
        m.mamba,
        Some(MambaState {
            heads: 8192,
            head_dim: 1,
            groups: 0,
            state_size: 16,
            conv_kernel: 4,
            conv_dtype: Dtype::Bf16,
            ssm_dtype: Dtype::Bf16,
        })
    );
    let spec = ModelSpec::of(m);
    for (tp, channels) in [(1u64, 8192u64), (2, 4096), (8, 1024)] {
        let ranks = build(&spec, mapping(tp as u32, 1, 1, false)).unwrap();
        let pt = &ranks[0].page_table;
        let kinds: Vec<GroupKind> = pt.groups.iter().map(|g| g.kind).collect();
        assert_eq!(kinds, [GroupKind::PAGED, GroupKind::STATE], "tp{tp}");
        let state = &pt.groups[1];
        assert_eq!(state.layers.len(), 28);
        // vLLM's mamba1_state_shape: conv (d_inner / tp) × (d_conv − 1), temporal
        // (d_inner / tp) × d_state, BF16.
        let conv = &state.views[0];
        assert_eq!(conv.layout.kind, LayoutKind::SECTIONED);
        assert_eq!(conv.layout.section_bytes.as_slice(), &[channels * 3 * 2]);
        assert_eq!(conv.entries[0].size, channels * 3 * 2);
        let ssm = &state.views[1];
        assert_eq!(ssm.layout.kind, LayoutKind::HND);
        assert_eq!(ssm.layout.dtype.as_str(), "bf16");
        assert_eq!(ssm.layout.shard_unit_bytes, 16 * 2);
        assert_eq!(ssm.entries[0].size, channels * 16 * 2);
        assert_eq!(
            (ssm.layout.num_shards, ssm.layout.shard_index),
            (tp as u32, 0)
        );
        assert_eq!(slot_bytes(&ranks[0], ssm.pool), 28 * channels * 16 * 2);
    }
    let offset = ModelShape::from_hf_config(
        r#"{"model_type": "jamba", "num_hidden_layers": 8, "attn_layer_period": 4,
            "attn_layer_offset": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "hidden_size": 256, "mamba_expand": 2, "mamba_d_state": 16, "mamba_d_conv": 4}"#,
        "cfg",
    )
    .unwrap_err()
    .to_string();
    assert!(
        offset.contains("`attn_layer_offset` (4) is not below attn_layer_period (4)"),
        "{offset}"
    );
}

#[test]
fn nemotron_h_8b_reads_attention_mamba_2_and_mlp_layers_from_its_pattern() {
    let m = load("nemotron-h-8b-base-8k.json");
    assert_eq!(m.architecture, "NemotronHForCausalLM");
    assert_eq!(m.num_layers(), 52);
    assert_eq!(layers_of(&m, LayerKind::Full), [7, 18, 29, 40]);
    assert_eq!(layers_of(&m, LayerKind::Mamba).len(), 24);
    assert_eq!(layers_of(&m, LayerKind::NoCache).len(), 24);
    // attention_head_dim 128.
    assert_eq!(
        m.attention,
        Attention::Heads {
            kv_heads: 8,
            head_dim: 128
        }
    );
    // The SSM state in FP32: the file sets no mamba_ssm_cache_dtype, and vLLM's
    // NemotronHForCausalLMConfig then takes float32.
    assert_eq!(
        m.mamba,
        Some(MambaState {
            heads: 128,
            head_dim: 64,
            groups: 8,
            state_size: 128,
            conv_kernel: 4,
            conv_dtype: Dtype::Bf16,
            ssm_dtype: Dtype::Fp32,
        })
    );
    // The same model as transformers 5.23 writes it: layers_block_type instead of the pattern,
    // and no num_hidden_layers.
    same_shape(&m, &load("nemotron-h-8b-base-8k-transformers5.json"));

    let spec = ModelSpec::of(m);
    for (tp, heads, groups) in [(1u64, 128u64, 8u64), (8, 16, 1)] {
        let ranks = build(&spec, mapping(tp as u32, 1, 1, false)).unwrap();
        let state = &ranks[0].page_table.groups[1];
        assert_eq!(state.kind, GroupKind::STATE);
        assert_eq!(state.layers.len(), 24);
        // vLLM's mamba2_state_shape: conv (d_conv − 1) × (heads·head_dim + 2·groups·state) / tp,
        // here x | B | C sections, BF16; temporal (heads / tp) × head_dim × state, FP32.
        let conv = &state.views[0].layout;
        assert_eq!(
            conv.section_bytes.as_slice(),
            &[
                heads * 64 * 3 * 2,
                groups * 128 * 3 * 2,
                groups * 128 * 3 * 2
            ],
            "tp{tp}"
        );
        let ssm = &state.views[1];
        assert_eq!(ssm.layout.dtype.as_str(), "fp32");
        assert_eq!(ssm.layout.shard_unit_bytes, 64 * 128 * 4);
        assert_eq!(ssm.entries[0].size, heads * 64 * 128 * 4);
    }
    // 8 groups over TP 16: vLLM would replicate them, which this layout does not describe.
    assert!(matches!(
        build(&spec, mapping(16, 1, 1, false)),
        Err(LayoutError::Sharding {
            what: "mamba groups",
            count: 8,
            width: 16,
            ..
        })
    ));
    // The MLP layers count in the PP split though they keep nothing.
    let pp2 = build(&spec, mapping(1, 2, 1, false)).unwrap();
    assert_eq!(pp2[1].pp_layer_range(), 26..52);
    let held: usize = pp2[0]
        .page_table
        .groups
        .iter()
        .map(|g| g.layers.len())
        .sum();
    // Layers 0..26: attention 7 and 18, twelve Mamba layers, twelve MLP layers in no group.
    assert_eq!(held, 14);

    let nemotron = |extra: &str| {
        ModelShape::from_hf_config(
            &format!(
                r#"{{"model_type": "nemotron_h", "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 64, "mamba_num_heads": 8,
                    "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16,
                    "conv_kernel": 4{extra}}}"#
            ),
            "nemotron",
        )
    };
    let bf16 =
        nemotron(r#", "hybrid_override_pattern": "M*E-", "mamba_ssm_cache_dtype": "bfloat16""#)
            .unwrap();
    assert_eq!(bf16.mamba.unwrap().ssm_dtype, Dtype::Bf16);
    assert_eq!(
        bf16.layers,
        [
            LayerKind::Mamba,
            LayerKind::Full,
            LayerKind::NoCache,
            LayerKind::NoCache
        ]
    );
    let bad = nemotron(r#", "hybrid_override_pattern": "M*X""#)
        .unwrap_err()
        .to_string();
    assert!(bad.contains("[2] is `X`"), "{bad}");
    let short = nemotron(r#", "num_hidden_layers": 4, "hybrid_override_pattern": "M*""#)
        .unwrap_err()
        .to_string();
    assert!(
        short.contains("`hybrid_override_pattern` has 2 layers, num_hidden_layers is 4"),
        "{short}"
    );
}

#[test]
fn an_unknown_model_type_is_refused_saying_how_to_describe_its_cache_by_hand() {
    let err = refused(r#"{"model_type": "mamba2", "num_hidden_layers": 64}"#);
    assert!(
        err.contains("model_type `mamba2` is not one kvferry knows"),
        "{err}"
    );
    for (known, _) in KNOWN_MODEL_TYPES {
        assert!(err.contains(known), "{known}: {err}");
    }
    assert!(err.contains(DESCRIBE_BY_HAND), "{err}");
    // The section it names exists and describes a rank's page table field by field.
    let guide =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../capi/README.md"))
            .unwrap();
    assert!(DESCRIBE_BY_HAND.contains("host/capi/README.md"));
    let heading = "## The configuration (JSON or TOML, version 1)";
    assert!(
        DESCRIBE_BY_HAND.contains(heading.trim_start_matches("## ")),
        "{DESCRIBE_BY_HAND}"
    );
    let section = &guide[guide.find(heading).expect("the section")..];
    assert!(
        section.contains("`page_table`") && section.contains("`groups`"),
        "{section}"
    );
}
