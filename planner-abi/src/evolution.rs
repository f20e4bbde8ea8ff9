//! # How the planner ABI evolves
//!
//! A planner library is built against one version of this crate and loaded by a host built
//! against possibly another. abi_stable checks, at load time, that every type reachable from
//! the root module has the same layout on both sides, and that the two versions of this crate
//! are semver-compatible (for `0.y.z`, the same `y`). A mismatch is refused with an
//! `AbiInstability` error naming the first differing type; the host reports its summary.
//!
//! ## Changes that keep old planners loadable (minor or patch release)
//!
//! - **Appending a field to the root module** after `new_planner`, the current
//!   `#[sabi(last_prefix_field)]`: [`PlannerModule`](crate::host::PlannerModule) is a prefix type.
//!   The new field must be read through its `Option`-returning accessor, and the host must
//!   keep working when an older library lacks it.
//! - **Appending a method to [`FfiPlanner`](crate::host::FfiPlanner)** after `forget_peer`, moving
//!   `#[sabi(last_prefix_field)]` to it: the vtable is a prefix type too. Give the matching
//!   [`TransferPlanner`](crate::TransferPlanner) method a default body.
//! - **New codes** for [`ErrorKind`](crate::ErrorKind), [`LayoutKind`](crate::LayoutKind),
//!   [`GroupKind`](crate::GroupKind) and [`MemoryType`](crate::MemoryType): they are integer
//!   newtypes, not enums, precisely so the set can grow. Consumers must refuse a code they do
//!   not know ([`PageTable::validate`](crate::PageTable::validate) does) rather than guess.
//! - New free functions, new inherent methods, new helper types that do not cross the
//!   boundary.
//!
//! ## Changes that break every planner (next `0.y` release)
//!
//! - Adding, removing, reordering or retyping a field of any `#[repr(C)]` type that crosses
//!   the boundary ([`RankInfo`](crate::RankInfo), [`PageTable`](crate::PageTable),
//!   [`LayerGroupRows`](crate::LayerGroupRows), [`TransferPlan`](crate::TransferPlan), ...).
//!   Carry new per-rank facts in `planner_blob` until the next breaking release instead.
//! - Changing a method's signature or the meaning of a field.
//!
//! `PlanError`'s boxed detail is a private `#[repr(C)]` enum (peer refusal or deployment
//! refusal): a new kind of detail is a breaking change, so the next one should come with the
//! next `0.y` release or travel in the message.
//!
//! ## History
//!
//! - **0.2** (breaking): `supports_deployment` returns a [`DeploymentRefusal`](crate::DeploymentRefusal),
//!   `PlanError` carries it; `specificity` appended to the root module (the first field added
//!   the compatible way: read through `PlannerModuleRef::specificity_level`, `GENERIC` when
//!   absent).
//!
//! ## Wire compatibility
//!
//! The same types travel between hosts with bincode 2 (serde). The host frames every message
//! with a protocol version and refuses a peer whose version differs, so a layout change here
//! must also bump that version.
