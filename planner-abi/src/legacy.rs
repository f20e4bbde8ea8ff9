//! The 0.2.0 interface, for hosts: how a host built against this version loads a planner
//! library built against 0.2.0.
//!
//! 0.2.1 appended [`pair_compressed`](crate::TransferPlanner::pair_compressed) to the planner
//! vtable, after its last prefix field. abi_stable (0.11.3) lets a host load a library whose
//! prefix types have *more* fields than the host's, but refuses one with fewer ("too many
//! fields", abi_stable issue 118), although the accessors would cope. So a host keeps the
//! 0.2.0 layouts here, type for type with the same names, and loads a library that its own
//! layout refuses through them ([`AnyPlannerModule`]); such a planner plans flat.
//!
//! Keep this module's types exactly as 0.2.0 released them.

use abi_stable::StableAbi;
use abi_stable::library::RootModule;
use abi_stable::sabi_trait;
use abi_stable::sabi_types::VersionStrings;
use abi_stable::std_types::{RBox, RResult, RSlice, RString, RVec};

use crate::{
    Deployment, LayerGroupRows, PairRequest, PeerTargets, PlanError, RankInfo, SlotTable,
    Specificity, TransferPlan, TransferPlanner,
};

/// The planner vtable of 0.2.0: [`crate::host::FfiPlanner`] without `pair_compressed`.
#[sabi_trait]
pub trait FfiPlanner: Send + Sync {
    /// See [`TransferPlanner::describe`].
    fn describe(&self) -> RResult<RVec<u8>, PlanError>;

    /// See [`TransferPlanner::check_peer`].
    fn check_peer(&self, me: &RankInfo, peer: &RankInfo) -> RResult<(), PlanError>;

    /// See [`TransferPlanner::targets`].
    fn targets(
        &self,
        me: &RankInfo,
        peer: &RankInfo,
        peer_dp_rank: u32,
    ) -> RResult<PeerTargets, PlanError>;

    /// See [`TransferPlanner::pair`].
    fn pair(
        &self,
        me: &RankInfo,
        peer: &RankInfo,
        my_rows: RSlice<'_, LayerGroupRows>,
        peer_rows: RSlice<'_, LayerGroupRows>,
        request: &PairRequest,
    ) -> RResult<TransferPlan, PlanError>;

    /// See [`TransferPlanner::receiver_payload_bytes`].
    fn receiver_payload_bytes(
        &self,
        me: &RankInfo,
        peer: &RankInfo,
        slot_tables: RSlice<'_, SlotTable>,
    ) -> RResult<u64, PlanError>;

    /// See [`TransferPlanner::forget_peer`].
    #[sabi(last_prefix_field)]
    fn forget_peer(&self, peer: &RankInfo) -> RResult<(), PlanError>;
}

/// A 0.2.0 planner behind the FFI boundary.
pub type PlannerBox = FfiPlanner_TO<'static, RBox<()>>;

/// The root module of 0.2.0: [`crate::host::PlannerModule`] whose `new_planner` returns a
/// 0.2.0 [`PlannerBox`].
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = PlannerModuleRef)))]
#[sabi(missing_field(panic))]
pub struct PlannerModule {
    /// The planner id.
    pub planner_id: extern "C" fn() -> RString,
    /// The describer id.
    pub describer_id: extern "C" fn() -> RString,
    /// The planner library's own version.
    pub version: extern "C" fn() -> RString,
    /// Whether the planner supports a deployment.
    pub supports_deployment: extern "C" fn(&Deployment) -> RResult<(), PlanError>,
    /// Builds the planner for one rank.
    #[sabi(last_prefix_field)]
    pub new_planner: extern "C" fn(&RankInfo) -> RResult<PlannerBox, PlanError>,
    /// How specific the planner is.
    #[sabi(missing_field(option))]
    pub specificity: extern "C" fn() -> u32,
}

impl std::fmt::Debug for PlannerModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlannerModule").finish_non_exhaustive()
    }
}

impl RootModule for PlannerModuleRef {
    abi_stable::declare_root_module_statics! {PlannerModuleRef}
    const BASE_NAME: &'static str = "kvferry_planner";
    const NAME: &'static str = "kvferry_planner";
    const VERSION_STRINGS: VersionStrings = abi_stable::package_version_strings!();
}

impl std::fmt::Debug for PlannerModuleRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlannerModuleRef(0.2.0)")
            .finish_non_exhaustive()
    }
}

/// A 0.2.0 planner, usable as a [`TransferPlanner`]: it has no compressed plans, so
/// `pair_compressed` keeps its default (none) and the host calls `pair`.
pub struct LoadedPlanner {
    inner: PlannerBox,
}

impl std::fmt::Debug for LoadedPlanner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedPlanner(0.2.0)")
            .finish_non_exhaustive()
    }
}

impl TransferPlanner for LoadedPlanner {
    crate::planner::forward_to_vtable!();
}

/// A planner library's root module, whichever supported interface it was built against.
#[derive(Clone, Copy, Debug)]
pub enum AnyPlannerModule {
    /// Built against this version (or a later 0.2.x, whose additions this host ignores).
    Current(crate::host::PlannerModuleRef),
    /// Built against 0.2.0: no compressed plans.
    Abi0_2_0(PlannerModuleRef),
}

impl AnyPlannerModule {
    /// The planner id.
    pub fn id(&self) -> String {
        match self {
            Self::Current(m) => m.id(),
            Self::Abi0_2_0(m) => (m.planner_id())().into_string(),
        }
    }

    /// The describer id.
    pub fn describer(&self) -> String {
        match self {
            Self::Current(m) => m.describer(),
            Self::Abi0_2_0(m) => (m.describer_id())().into_string(),
        }
    }

    /// The planner library's version.
    pub fn library_version(&self) -> String {
        match self {
            Self::Current(m) => m.library_version(),
            Self::Abi0_2_0(m) => (m.version())().into_string(),
        }
    }

    /// How specific the planner declares itself.
    pub fn specificity_level(&self) -> Specificity {
        match self {
            Self::Current(m) => m.specificity_level(),
            Self::Abi0_2_0(m) => m
                .specificity()
                .map_or(Specificity::GENERIC, |f| Specificity(f())),
        }
    }

    /// The interface version the library was built against, as far as this host tells.
    pub fn interface(&self) -> &'static str {
        match self {
            Self::Current(_) => env!("CARGO_PKG_VERSION"),
            Self::Abi0_2_0(_) => "0.2.0",
        }
    }

    /// Asks the planner whether it supports `deployment`.
    ///
    /// # Errors
    ///
    /// `UNSUPPORTED` with the planner's refusal, or `PANICKED`.
    pub fn check_deployment(&self, deployment: &Deployment) -> Result<(), PlanError> {
        match self {
            Self::Current(m) => m.check_deployment(deployment),
            Self::Abi0_2_0(m) => (m.supports_deployment())(deployment).into_result(),
        }
    }

    /// Builds the planner for one rank.
    ///
    /// # Errors
    ///
    /// Whatever the planner's constructor returns, or `PANICKED`.
    pub fn instantiate(&self, me: &RankInfo) -> Result<Box<dyn TransferPlanner>, PlanError> {
        match self {
            Self::Current(m) => m
                .instantiate(me)
                .map(|p| Box::new(p) as Box<dyn TransferPlanner>),
            Self::Abi0_2_0(m) => (m.new_planner())(me)
                .into_result()
                .map(|inner| Box::new(LoadedPlanner { inner }) as Box<dyn TransferPlanner>),
        }
    }
}
