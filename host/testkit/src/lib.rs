//! kvferry-testkit: model presets, the byte oracle, in-process scenarios and the planner
//! conformance harness — everything a planner team needs to prove its planner, with no UCX.
//!
//! - [`layout`]: model presets with real dimensions (DeepSeek-V3, Llama-3-70B, Qwen3-Next,
//!   gpt-oss) and the per-rank page tables a deployment of them advertises.
//! - [`hf_config`]: models from their Hugging Face `config.json` (Llama, Mistral, Qwen2/3,
//!   Qwen2.5-VL, Qwen3-Next, DeepSeek-V2/V3, gpt-oss, Phi-3, Gemma-2/3, Llama-4, Jamba and
//!   Nemotron-H shapes), for the layouts [`layout`] builds.
//! - [`builder`]: hand-built page tables and ranks of any shape (synthetic models, any
//!   mapping), slot tables, rows and pieces.
//! - [`oracle`]: tag-filled source pools, canary-primed destinations, every byte checked;
//!   [`oracle::LocalMemory`] executes validated plans in process.
//! - [`scenario`]: one request end to end in process (plan every pair, move, verify), from a
//!   preset ([`scenario::Scenario`]), from hand-built deployments ([`scenario::Transfer`]) or
//!   from ranks given one by one ([`scenario::Exchange`]).
//! - [`conform`]: the oracle matrix every planner is proven against (`kvferry conform`), a
//!   planner under test ([`conform::PlannerUnderTest`]) and what the conformance tests share.
//! - [`units`]: byte counts with their size in binary units, for reports.
//! - [`error_chain`]: an error and its causes on one line, for messages and assertions.
//!
//! Depends on `kvferry-planner-abi`, `kvferry-plan` and `kvferry-loader` only, never on UCX
//! or CUDA, so a planner built out of tree can run it in its own tests.

#![deny(missing_docs)]

pub mod builder;
pub mod conform;
pub mod hf_config;
pub mod layout;
pub mod oracle;
pub mod scenario;
pub use kvferry_platform::units;

pub use kvferry_plan::error_chain;

/// The conformance kit's former path, for planners written against it: now [`conform`].
#[doc(hidden)]
pub mod conformance {
    pub use crate::conform::{
        CASE_FILTER_ENV, Case, OUT_OF_TREE_PROFILE, OUT_OF_TREE_TARGET, PlannerUnderTest,
        build_dir, build_out_of_tree, canonical, plugin_dir_with, repo_root, selected, tempdir,
    };
}

/// A hand-built request's former path, for planners written against it: now [`scenario`].
#[doc(hidden)]
pub mod request {
    pub use crate::scenario::{Transfer, request_tables};
}
