//! The root module every planner library exports, and the macro that exports it.

use abi_stable::library::RootModule;
use abi_stable::prefix_type::PrefixTypeTrait;
use abi_stable::sabi_types::VersionStrings;
use abi_stable::std_types::{RBox, RResult, RString};
use abi_stable::{StableAbi, sabi_trait::TD_Opaque};

use crate::planner::{Exported, FfiPlanner_TO, LoadedPlanner, guard};
use crate::{Deployment, PlanError, PlannerPlugin, RankInfo, Specificity};

/// The root module of a planner library: a prefix type, so later versions of `planner-abi`
/// may append fields after `new_planner` without breaking libraries built against this one
/// (`specificity` is the first such field).
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = PlannerModuleRef)))]
#[sabi(missing_field(panic))]
pub struct PlannerModule {
    /// The planner id both sides must agree on.
    pub planner_id: extern "C" fn() -> RString,
    /// The describer id both sides must agree on.
    pub describer_id: extern "C" fn() -> RString,
    /// The planner library's own version.
    pub version: extern "C" fn() -> RString,
    /// Whether the planner supports a deployment; the error carries the reason, with a
    /// [`DeploymentRefusal`](crate::DeploymentRefusal) when the planner refused it.
    pub supports_deployment: extern "C" fn(&Deployment) -> RResult<(), PlanError>,
    /// Builds the planner for one rank.
    #[sabi(last_prefix_field)]
    pub new_planner: extern "C" fn(&RankInfo) -> RResult<crate::host::PlannerBox, PlanError>,
    /// How specific the planner is ([`Specificity`]), for automatic selection. Appended after
    /// the last prefix field: a library without it counts as [`Specificity::GENERIC`].
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
        f.debug_struct("PlannerModuleRef")
            .field("planner_id", &self.id())
            .finish_non_exhaustive()
    }
}

impl PlannerModuleRef {
    /// The planner id.
    pub fn id(&self) -> String {
        (self.planner_id())().into_string()
    }

    /// The describer id.
    pub fn describer(&self) -> String {
        (self.describer_id())().into_string()
    }

    /// The planner library's version.
    pub fn library_version(&self) -> String {
        (self.version())().into_string()
    }

    /// How specific the planner declares itself ([`Specificity::GENERIC`] for a library
    /// that predates the declaration).
    pub fn specificity_level(&self) -> Specificity {
        self.specificity()
            .map_or(Specificity::GENERIC, |f| Specificity(f()))
    }

    /// Asks the planner whether it supports `deployment`.
    ///
    /// # Errors
    ///
    /// `UNSUPPORTED` with the planner's [`DeploymentRefusal`](crate::DeploymentRefusal), or
    /// `PANICKED`.
    pub fn check_deployment(&self, deployment: &Deployment) -> Result<(), PlanError> {
        (self.supports_deployment())(deployment).into_result()
    }

    /// Builds the planner for one rank.
    ///
    /// # Errors
    ///
    /// Whatever the planner's constructor returns, or `PANICKED`.
    pub fn instantiate(&self, me: &RankInfo) -> Result<LoadedPlanner, PlanError> {
        (self.new_planner())(me)
            .into_result()
            .map(LoadedPlanner::new)
    }
}

/// Supplies the planner library's version to [`module_of`]; implemented by
/// [`export_planner!`](crate::export_planner) with the library's `CARGO_PKG_VERSION`.
#[doc(hidden)]
pub trait PluginVersion {
    const VERSION: &'static str;
}

extern "C" fn planner_id_of<T: PlannerPlugin>() -> RString {
    RString::from(T::PLANNER_ID)
}

extern "C" fn describer_id_of<T: PlannerPlugin>() -> RString {
    RString::from(T::DESCRIBER_ID)
}

extern "C" fn version_of<T: PluginVersion>() -> RString {
    RString::from(T::VERSION)
}

extern "C" fn specificity_of<T: PlannerPlugin>() -> u32 {
    T::SPECIFICITY.0
}

extern "C" fn supports_deployment_of<T: PlannerPlugin>(
    deployment: &Deployment,
) -> RResult<(), PlanError> {
    guard("supports_deployment", || {
        T::supports_deployment(deployment).map_err(PlanError::unsupported_deployment)
    })
}

extern "C" fn new_planner_of<T: PlannerPlugin>(
    me: &RankInfo,
) -> RResult<crate::host::PlannerBox, PlanError> {
    guard("new_planner", || {
        T::new(me).map(|p| FfiPlanner_TO::from_value(Exported(p), TD_Opaque))
    })
}

/// The root module for planner `T`. Used by [`export_planner!`](crate::export_planner), and by
/// hosts and tests that link a planner statically to drive it exactly as a loaded one.
pub fn module_of<T: PlannerPlugin + PluginVersion>() -> PlannerModuleRef {
    PlannerModule {
        planner_id: planner_id_of::<T>,
        describer_id: describer_id_of::<T>,
        version: version_of::<T>,
        supports_deployment: supports_deployment_of::<T>,
        new_planner: new_planner_of::<T>,
        specificity: specificity_of::<T>,
    }
    .leak_into_prefix()
}

/// Keeps `RBox` in scope for the `FfiPlanner_TO<'static, RBox<()>>` alias in docs.
#[allow(dead_code)]
type _Box = RBox<()>;

/// Exports a planner from a `cdylib`: generates the library's root module and wraps every
/// entry point so that a panic becomes a `PANICKED` [`PlanError`] instead of ending the host
/// process.
///
/// It also defines `pub fn planner_module() -> PlannerModuleRef` in the calling module, so the
/// same crate built as an `rlib` can be driven statically.
///
/// The export is the fixed, unmangled symbol abi_stable's loader looks for, so **one binary
/// can link at most one planner statically**: linking two planner `rlib`s into one executable
/// fails with a duplicate-symbol error from the linker. Load the others from their `.so`
/// instead (as the host always does); a test binary that needs two planners links one and
/// loads the other, or loads both.
///
/// ```ignore
/// kvferry_planner_abi::export_planner!(MyPlanner);
/// ```
#[macro_export]
macro_rules! export_planner {
    ($planner:ty) => {
        impl $crate::__private::PluginVersion for $planner {
            const VERSION: &'static str = env!("CARGO_PKG_VERSION");
        }

        /// This library's planner as a root module (for static linking and tests).
        pub fn planner_module() -> $crate::host::PlannerModuleRef {
            $crate::__private::module_of::<$planner>()
        }

        /// The symbol abi_stable's loader looks up (`lib_header_from_path`).
        #[allow(unsafe_code, non_upper_case_globals)]
        #[unsafe(no_mangle)]
        pub static _1as_0lib_1header_0root_bmodule_bloader: $crate::__private::LibHeader = {
            extern "C" fn __kvferry_root_module() -> $crate::__private::RootModuleResult {
                $crate::__private::call_root_module_loader(planner_module)
            }
            // SAFETY: `__kvferry_root_module` returns the root module of type
            // `PlannerModuleRef`, the type named here, as `LibHeader::from_constructor`
            // requires.
            unsafe {
                $crate::__private::LibHeader::from_constructor::<$crate::host::PlannerModuleRef>(
                    __kvferry_root_module,
                    $crate::__private::CheckTypeLayout::Yes,
                )
            }
        };
    };
}
