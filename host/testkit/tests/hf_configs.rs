//! Models from their Hugging Face `config.json` (`tests/fixtures/hf/`): the published models'
//! configs give exactly the presets' layouts, the tiny models the real-model and vLLM checks
//! build give theirs, and what cannot be read is refused by name.

use std::path::{Path, PathBuf};

use kvferry_planner_abi::GroupKind;
use kvferry_testkit::hf_config::ConfigError;
use kvferry_testkit::layout::{
    Attention, Dtype, LayerKind, LinearAttention, ModelShape, ModelSpec, Preset,
};

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
