//! `--model config.json` for the model families read beyond the presets' (Gemma-3, Phi-3,
//! Llama-4, Qwen2.5-VL, Jamba), as a user runs it: `check` accepts each published config and
//! binds a planner to it, and `plan` moves the bytes its cache shape implies (published
//! dimensions, worked out by hand below).

use crate::support;

use serde_json::Value;
use support::{Kvferry, hf_config};

/// `kvferry plan --json` of one `prompt`-token request from `ctx` to `decode`, dry run.
fn plan(file: &str, ctx: &str, decode: &str, prompt: u64) -> Value {
    Kvferry::new()
        .quiet()
        .args([
            "plan",
            "--model",
            &hf_config(file),
            "--ctx",
            ctx,
            "--gen",
            decode,
            "--prompt-len",
            &prompt.to_string(),
            "--json",
        ])
        .json()
}

/// `kvferry check --json` of `file` on `deployment`.
fn check_json(file: &str, deployment: &str) -> Value {
    Kvferry::new()
        .quiet()
        .args([
            "check",
            "--model",
            &hf_config(file),
            "--deployment",
            deployment,
            "--json",
        ])
        .json()
}

/// Per token and attention layer: K and V of `kv_heads` × `head_dim` BF16 elements.
fn kv_bytes(kv_heads: u64, head_dim: u64) -> u64 {
    2 * kv_heads * head_dim * 2
}

#[test]
fn check_accepts_the_published_configs_of_more_model_families() {
    for (file, deployment, architecture) in [
        ("gemma-3-27b.json", "tp4", "Gemma3ForConditionalGeneration"),
        ("phi-3-medium-4k-instruct.json", "tp2", "Phi3ForCausalLM"),
        (
            "llama-4-scout-17b-16e-instruct.json",
            "tp8",
            "Llama4ForConditionalGeneration",
        ),
        (
            "qwen2.5-vl-7b-instruct.json",
            "tp4",
            "Qwen2_5_VLForConditionalGeneration",
        ),
        ("jamba-1.5-mini.json", "tp2", "JambaForCausalLM"),
    ] {
        let v = check_json(file, deployment);
        assert_eq!(
            v["deployment"],
            format!("{architecture} {deployment}"),
            "{file}: {v}"
        );
        assert_eq!(v["bound"], "kvferry.default", "{file}: {v}");
        assert_eq!(v["error"], Value::Null, "{file}: {v}");
    }
}

#[test]
fn plan_moves_what_each_families_cache_shape_holds() {
    let prompt = 4096u64;
    // Gemma-3-27B: 10 global layers (every 6th) hold all 4096 tokens; 52 local ones the
    // 1024-token window, the blocks from (4096 + 1 − 1024) / 32 = 96 on: 32 blocks of 32.
    // 16 KV heads × 128.
    let gemma = kv_bytes(16, 128) * (10 * prompt + 52 * 1024);
    // Phi-3-medium: all 40 layers slide over 2047 tokens, 64 blocks from (4097 − 2047) / 32;
    // 10 KV heads × 128 (5120 / 40).
    let phi = kv_bytes(10, 128) * 40 * 2048;
    // Llama-4-Scout: 12 full layers and 36 chunked over 8192 tokens, a chunk longer than the
    // prompt; 8 KV heads × 128.
    let scout = kv_bytes(8, 128) * 48 * prompt;
    // Qwen2.5-VL-7B: 28 full layers, 4 KV heads × 128 (3584 / 28).
    let qwen = kv_bytes(4, 128) * 28 * prompt;
    // Jamba-1.5-Mini: 4 attention layers, 8 KV heads × 128 (4096 / 32); 28 Mamba layers of
    // 8192 channels (mamba_expand 2 × 4096): conv 3 steps (mamba_d_conv 4 − 1) and 16 SSM
    // states (mamba_d_state) per channel, BF16.
    let jamba_state = 28 * 8192 * (3 + 16) * 2;
    let jamba = kv_bytes(8, 128) * 4 * prompt + jamba_state;
    for (file, bytes, state) in [
        ("gemma-3-27b.json", gemma, 0),
        ("phi-3-medium-4k-instruct.json", phi, 0),
        ("llama-4-scout-17b-16e-instruct.json", scout, 0),
        ("qwen2.5-vl-7b-instruct.json", qwen, 0),
        ("jamba-1.5-mini.json", jamba, jamba_state),
    ] {
        let v = plan(file, "tp2", "tp1", prompt);
        assert_eq!(v["total_bytes"], bytes, "{file}: {v}");
        // Recurrent state lands once per request on the receiver.
        assert_eq!(v["receivers"][0]["payload_bytes"], state, "{file}: {v}");
    }
}

/// `check` prints each family's cache: its layers by kind, then what one rank's groups hold
/// per block (or per sequence), here worked out from the published dimensions at tp2, 32
/// tokens per block, BF16.
#[test]
fn check_prints_each_familys_cache_shape() {
    let per_layer = |kv_heads: u64| 32 * kv_bytes(kv_heads / 2, 128);
    for (file, model_line, groups) in [
        (
            "gemma-3-27b.json",
            "62 layers: 10 full attention, 52 sliding window of 1024 tokens",
            // 16 KV heads; 52 sliding layers then 10 global ones.
            vec![
                ("paged", Some(1024), 52, 52 * per_layer(16)),
                ("paged", None, 10, 10 * per_layer(16)),
            ],
        ),
        (
            "jamba-1.5-mini.json",
            "32 layers: 4 full attention, 28 Mamba (recurrent state)",
            // 8 KV heads on 4 layers; per Mamba layer and sequence, d_inner 8192 / 2 channels
            // of conv state (kernel 4: 3 steps) and SSM state (16), BF16.
            vec![
                ("paged", None, 4, 4 * per_layer(8)),
                ("state", None, 28, 28 * 4096 * (3 + 16) * 2),
            ],
        ),
    ] {
        let text = Kvferry::new()
            .quiet()
            .args(["check", "--model", &hf_config(file), "--deployment", "tp2"])
            .stdout();
        assert!(
            text.contains(&format!("cache: {model_line}")),
            "{file}:\n{text}"
        );
        let v = check_json(file, "tp2");
        for rank in 0..2 {
            let got = &v["ranks"][rank];
            assert_eq!(
                got.as_array().map(Vec::len),
                Some(groups.len()),
                "{file}: {v}"
            );
            for (g, (kind, window, layers, bytes)) in groups.iter().enumerate() {
                assert_eq!(got[g]["kind"], *kind, "{file} group {g}: {v}");
                assert_eq!(
                    got[g]["window"],
                    serde_json::json!(window),
                    "{file} group {g}: {v}"
                );
                assert_eq!(got[g]["layers"], *layers, "{file} group {g}: {v}");
                assert_eq!(got[g]["bytes_per_slot"], *bytes, "{file} group {g}: {v}");
            }
        }
        assert!(
            text.contains("ranks 0-1: group 0: paged"),
            "{file}:\n{text}"
        );
    }
}
