//! The cache `kvferry check` describes: the model's layers by what they keep, then what one
//! rank's layer groups hold per block (or per sequence, for recurrent state).

use kvferry_planner_abi::{GroupKind, RankInfo};
use kvferry_testkit::layout::{Attention, LayerKind, ModelSpec};
use kvferry_testkit::units;
use serde_json::{Value, json};

/// One line on the model's cache: its layers by kind and what an attention layer keeps per
/// token, with the element type and block size.
pub(crate) fn model_line(model: &ModelSpec) -> String {
    let shape = &model.model;
    let count = |kind: LayerKind| shape.layers.iter().filter(|&&k| k == kind).count();
    let mut kinds = Vec::new();
    let window = shape
        .sliding_window
        .map_or(String::new(), |w| format!(" of {w} tokens"));
    for (kind, what) in [
        (LayerKind::Full, "full attention".to_string()),
        (LayerKind::Sliding, format!("sliding window{window}")),
        (
            LayerKind::Linear,
            "linear attention (recurrent state)".to_string(),
        ),
        (LayerKind::Mamba, "Mamba (recurrent state)".to_string()),
        (LayerKind::NoCache, "keeping nothing".to_string()),
    ] {
        match count(kind) {
            0 => {}
            n => kinds.push(format!("{n} {what}")),
        }
    }
    let per_token = match shape.attention {
        Attention::Heads { kv_heads, head_dim } => {
            format!("K and V of {kv_heads} heads x {head_dim}")
        }
        Attention::Latent { dim } => format!("one latent vector of {dim} (MLA)"),
    };
    format!(
        "{} layers: {}; attention keeps {per_token} per token, {}, {} tokens per block",
        shape.layers.len(),
        kinds.join(", "),
        model.dtype,
        model.tokens_per_block
    )
}

/// What each layer group of `rank` holds: lines for people, and the same as JSON.
pub(crate) fn rank_groups(rank: &RankInfo) -> (Vec<String>, Value) {
    let table = &rank.page_table;
    let mut lines = Vec::new();
    let mut groups = Vec::new();
    for (index, group) in table.groups.iter().enumerate() {
        let per_slot: u64 = group
            .views
            .iter()
            .flat_map(|v| v.entries.iter())
            .map(|e| e.size)
            .sum();
        let roles: Vec<&str> = group
            .views
            .iter()
            .flat_map(|v| v.roles.iter().map(|r| r.as_str()))
            .collect();
        let state = group.kind == GroupKind::STATE;
        let unit = if state { "sequence" } else { "block" };
        let kind = group.kind.name().unwrap_or("unknown");
        let window = group
            .window
            .into_option()
            .map_or(String::new(), |w| format!(", window {w} tokens"));
        lines.push(format!(
            "group {index}: {kind}{window}, {} layers, {} per {unit} ({})",
            group.layers.len(),
            units::size(per_slot),
            roles.join(", ")
        ));
        groups.push(json!({
            "kind": kind,
            "window": group.window.into_option(),
            "layers": group.layers.len(),
            "roles": roles,
            "bytes_per_slot": per_slot,
            "slot": unit,
        }));
    }
    (lines, Value::Array(groups))
}
