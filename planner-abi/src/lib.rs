//! The stable ABI every kvferry planner is built against.
//!
//! kvferry moves a request's KV cache from a prefill (context) server to a decode
//! (generation) server. *Which bytes go where* depends on the model's cache layout and on how each
//! side is sharded; a **planner** decides it. Planners are plugins: each is its own `cdylib`,
//! dropped into a plugin directory and loaded by the host at run time. This crate is the only
//! thing a planner depends on.
//!
//! # Glossary
//!
//! - **interface crate**: this crate. It defines the data model, the [`TransferPlanner`]
//!   trait and the root module every planner library exports.
//! - **implementation crate**: a planner library (`crate-type = ["cdylib", "rlib"]`).
//! - **user crate**: the host (`kvferry`), which loads implementation crates.
//! - **root module**: the [`host::PlannerModule`] a library exports; the host reads the
//!   planner's id, describer id, version and [`Specificity`] from it, asks
//!   [`host::PlannerModuleRef::check_deployment`], then builds one planner per rank with
//!   [`host::PlannerModuleRef::instantiate`].
//! - **rows**: what one side holds for one request, computed by the default describer
//!   [`rows`] from a [`PageTable`] and the request's [`SlotTable`]s.
//!
//! # Writing a planner
//!
//! 1. Create a library crate with `crate-type = ["cdylib", "rlib"]` that depends on
//!    `kvferry-planner-abi` alone (copy `examples/planner-template`).
//! 2. Implement [`TransferPlanner`]: the peer check, the targets, and `pair`, which turns the
//!    rows both sides described into `(src, dst, len)` fragments. When your plan repeats one
//!    pattern of fragments for every pair of rows (most do), also implement
//!    [`pair_compressed`](TransferPlanner::pair_compressed) returning a [`CompressedPlan`],
//!    and let `pair` return its [`expand`](CompressedPlan::expand)ed form: the host then
//!    validates and carries the pattern instead of every fragment.
//! 3. Implement [`PlannerPlugin`]: the id, the [`Specificity`], `supports_deployment` (a
//!    [`DeploymentRefusal`] naming the field when it says no) and the constructor.
//! 4. Add one line: `export_planner!(MyPlanner);`.
//! 5. `cargo build --release`, copy `target/release/lib<name>.so` into a directory on
//!    `KVFERRY_PLUGIN_DIR`, and set `KVFERRY_PLANNER=<your id>` on both servers.
//!
//! A minimal planner for a model with one PAGED layer group whose single view is laid out
//! identically on both sides (one rank per side, no sharding), writing whole rows:
//!
//! ```
//! use kvferry_planner_abi::{
//!     export_planner, Deployment, DeploymentRefusal, LayerGroupRows, PairRequest,
//!     PeerTargets, PlanError, PlannerPlugin, RankInfo, Specificity, TransferPlan,
//!     TransferPlanner,
//! };
//!
//! pub struct WholeRows;
//!
//! impl TransferPlanner for WholeRows {
//!     fn check_peer(&self, me: &RankInfo, peer: &RankInfo) -> Result<(), PlanError> {
//!         let (ours, theirs) = (&me.page_table, &peer.page_table);
//!         if ours.tokens_per_block != theirs.tokens_per_block {
//!             return Err(PlanError::refuse(
//!                 "tokens_per_block",
//!                 ours.tokens_per_block,
//!                 theirs.tokens_per_block,
//!                 "rows must hold the same tokens on both sides",
//!             ));
//!         }
//!         Ok(())
//!     }
//!
//!     fn targets(&self, _: &RankInfo, _: &RankInfo, _: u32) -> Result<PeerTargets, PlanError> {
//!         Ok(PeerTargets { ranks: vec![0].into(), uniform: true })
//!     }
//!
//!     fn pair(
//!         &self,
//!         _me: &RankInfo,
//!         _peer: &RankInfo,
//!         mine: &[LayerGroupRows],
//!         theirs: &[LayerGroupRows],
//!         request: &PairRequest,
//!     ) -> Result<TransferPlan, PlanError> {
//!         let mut plan = TransferPlan::new();
//!         let (Some(src), Some(dst)) = (mine.first(), theirs.first()) else {
//!             return Ok(plan);
//!         };
//!         let tpb = 32; // tokens per block, checked equal in check_peer
//!         let (lo, hi) = (request.token_range.start / tpb, request.token_range.end.div_ceil(tpb));
//!         for (k, &ordinal) in src.ordinals.iter().enumerate() {
//!             if (lo..hi).contains(&ordinal) {
//!                 if let Some(d) = dst.address_of(ordinal) {
//!                     plan.push(src.addresses[k], d, src.row_bytes);
//!                 }
//!             }
//!         }
//!         Ok(plan)
//!     }
//! }
//!
//! impl PlannerPlugin for WholeRows {
//!     const PLANNER_ID: &'static str = "example.whole_rows";
//!     // Any architecture, but only one rank per side.
//!     const SPECIFICITY: Specificity = Specificity::GENERIC;
//!
//!     fn supports_deployment(d: &Deployment) -> Result<(), DeploymentRefusal> {
//!         match d.mapping.world_size() {
//!             1 => Ok(()),
//!             n => Err(DeploymentRefusal::new(
//!                 "mapping.world_size",
//!                 n,
//!                 1,
//!                 "rows are copied whole, so each side must be one rank",
//!             )),
//!         }
//!     }
//!
//!     fn new(_: &RankInfo) -> Result<Self, PlanError> {
//!         Ok(WholeRows)
//!     }
//! }
//!
//! export_planner!(WholeRows);
//!
//! // The same crate linked statically exposes its root module too:
//! let module = planner_module();
//! assert_eq!(module.id(), "example.whole_rows");
//! ```
//!
//! # Rules a planner lives by
//!
//! - It is pure computation: no I/O, no clock, no UCX, no CUDA, no `unsafe`.
//! - It never addresses memory itself; it returns addresses computed from the rows, and the
//!   host validates every fragment against both sides' rows before a byte moves.
//! - Panics are caught at the boundary ([`ErrorKind::PANICKED`]); still, return errors.
//! - Libraries are never unloaded: do not rely on destructors of statics.
//!
//! The [`evolution`] chapter says which changes to this crate keep old planners loadable.

#![deny(missing_docs)]
#![deny(unsafe_code)]

pub mod evolution;

/// This crate's version: the planner ABI a host built with it loads planners against
/// (`kvferry doctor` prints it). A planner built against the same `0.x` loads.
pub const ABI_VERSION: &str = env!("CARGO_PKG_VERSION");

mod error;
mod layout;
// The 0.2.0 layouts hosts still load: abi_stable's #[sabi_trait] and prefix-type derives
// expand to unsafe code; what this module writes is safe.
#[allow(unsafe_code)]
mod legacy;
// abi_stable's prefix-type derive reads a field after the last prefix field (`specificity`)
// through a pointer once it has checked the library's field count: generated code we cannot
// change, so this module alone allows it.
#[allow(unsafe_code)]
mod module;
mod plan;
// abi_stable's #[sabi_trait] expands to `unsafe impl`s and unsafe vtable calls; the code we
// write in this module is safe.
#[allow(unsafe_code)]
mod planner;
mod rank;
mod request;
mod rows;

pub use error::{DeploymentRefusal, ErrorKind, PeerRefusal, PlanError};
pub use layout::{
    BufferEntry, GroupKind, LayerGroup, LayerRange, LayoutKind, LocalLayer, MemoryType, PageTable,
    PhysicalPool, PoolView, RoleLayout,
};
pub use plan::{CompressedPlan, ExpandError, PeerTargets, PlanPattern, TransferPlan};
pub use planner::{PlannerPlugin, TransferPlanner};
pub use rank::{Deployment, Mapping, MappingParseError, RankCoords, RankInfo, Specificity};
pub use request::{PairRequest, SlotTable, TokenRange, ViewId};
pub use rows::{DEFAULT_DESCRIBER_ID, LayerGroupRows, rows};

/// Host plumbing: what a host (or a test that drives a planner exactly as the host does)
/// needs to load and call a planner library. Planner authors do not name these; they write
/// [`TransferPlanner`] and [`PlannerPlugin`] and one [`export_planner!`] line.
pub mod host {
    pub use crate::legacy::AnyPlannerModule;
    pub use crate::module::{PlannerModule, PlannerModuleRef, module_of};
    pub use crate::planner::{FfiPlanner, FfiPlanner_TO, LoadedPlanner, PlannerBox};

    /// The 0.2.0 interface's layouts, which a host loads a library built against 0.2.0
    /// through (see [`AnyPlannerModule`]).
    pub mod abi_0_2_0 {
        pub use crate::legacy::{
            FfiPlanner, FfiPlanner_TO, LoadedPlanner, PlannerBox, PlannerModule, PlannerModuleRef,
        };
    }
}

/// Re-exported so hosts can spell FFI string and vector types without naming abi_stable.
pub mod ffi {
    pub use abi_stable::std_types::{ROption, RSlice, RString, RVec};
}

/// Items used by [`export_planner!`]; not part of the public API.
#[doc(hidden)]
pub mod __private {
    pub use abi_stable::library::{
        __call_root_module_loader as call_root_module_loader, CheckTypeLayout, LibHeader,
        RootModuleResult,
    };

    pub use crate::module::{PluginVersion, module_of};
}
