//! Runnable examples of the kvferry library API (the `kvferry` CLI is built on the same
//! calls):
//!
//! - `cargo run -p kvferry-examples --bin plan_request -- [PLANNER_ID]`: loads the planners
//!   next to the executable, binds one for DeepSeek-V3 dep4 and dep8, plans a 4,096-token
//!   request between them, executes it in memory and checks every byte with the oracle.
//!
//! The out-of-tree planner template lives in `examples/planner-template` (its own
//! workspace).
//!
//! The engine example (`engine_prefill`, `engine_decode`, `engine_decode_failover`; shared
//! code in [`engine`]): a prefill and a decode "engine", one process per rank, each over its
//! own pools in its own layout, moving requests with the per-rank agent alone. See
//! `examples/tests/engine.rs` for how they are run together.

pub mod engine;
