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
//! - **Appending a method to [`FfiPlanner`](crate::host::FfiPlanner)** after the last one,
//!   leaving `#[sabi(last_prefix_field)]` where it is (on `forget_peer`; moving it is a
//!   breaking change), with a default body there and on the matching
//!   [`TransferPlanner`](crate::TransferPlanner) method. abi_stable lets an older host load
//!   the newer library; the reverse, a newer host loading an older library, it refuses
//!   ("too many fields": abi_stable 0.11.3 checks that the host's prefix type has no more
//!   fields than the library's, issue 118). So the host must also keep the previous
//!   release's layouts, type for type under the same names, and load a library its own
//!   layout refuses through them: [`host::abi_0_2_0`](crate::host::abi_0_2_0) and
//!   [`host::AnyPlannerModule`](crate::host::AnyPlannerModule) do this for 0.2.0, and
//!   `tests/fixtures/abi-0.2.0` (a planner built against the frozen 0.2.0 source) proves it.
//!   0.2.1 appended `pair_compressed` this way.
//! - **Appending a field to the root module** after `new_planner` works the same way and
//!   needs the same fallback (read it through its `Option`-returning accessor).
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
//! - **0.2.1** (compatible): compressed plans ([`CompressedPlan`](crate::CompressedPlan),
//!   [`TransferPlanner::pair_compressed`](crate::TransferPlanner::pair_compressed)), appended
//!   to the vtable; hosts load 0.2.0 libraries through the kept 0.2.0 layouts.
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
