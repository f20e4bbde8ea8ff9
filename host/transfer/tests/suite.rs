//! The transfer layer: agents and rank threads over real UCX, every byte checked.
//!
//! One test binary for this crate's integration tests (each file below is a module), so
//! they link once; run one file's tests with `cargo test -p <crate> --test suite <file>::`.

mod agent;
mod agent_bounce;
mod agent_bounds;
mod agent_departure;
mod agent_hold;
mod agent_keepalive;
mod agent_layers;
mod agent_planner;
mod coverage;
mod integrity;
mod key_owner;
mod key_range;
mod namespaces;
mod peer_failure;
mod rank_bounds;
mod security;
mod squatting;
mod support;
