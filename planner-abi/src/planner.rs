//! The planner interface: the Rust trait authors implement, and its FFI-safe twin.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};

use abi_stable::sabi_trait;
use abi_stable::std_types::{RBox, ROption, RResult, RSlice, RVec};

use crate::{
    CompressedPlan, Deployment, DeploymentRefusal, LayerGroupRows, PairRequest, PeerTargets,
    PlanError, RankInfo, SlotTable, Specificity, TransferPlan,
};

/// The two-sided half of a model's transfer logic: one instance per rank.
///
/// The host drives it at these points (semantics §8.5, §9):
/// - [`describe`](Self::describe) once, stamped on this rank's [`RankInfo::planner_blob`];
/// - [`check_peer`](Self::check_peer) once per peer at registration;
/// - [`targets`](Self::targets) per request on both sides;
/// - [`pair_compressed`](Self::pair_compressed) on the sender for every piece of every
///   request, then [`pair`](Self::pair) when it answers `None`;
/// - [`receiver_payload_bytes`](Self::receiver_payload_bytes) on the receiver;
/// - [`forget_peer`](Self::forget_peer) when a peer goes away.
///
/// Methods take `&self` and may be called from several threads: keep per-peer caches behind
/// a lock. Implementations are pure computation: no I/O, no clock, no unsafe code. A panic
/// is caught at the plugin boundary and becomes a [`PlanError`] of kind `PANICKED`; a lock
/// poisoned by it should be recovered (`PoisonError::into_inner`) or the caches rebuilt.
pub trait TransferPlanner: Send + Sync {
    /// An opaque self-description that only the same planner on the peer decodes.
    fn describe(&self) -> Result<Vec<u8>, PlanError> {
        Ok(Vec::new())
    }

    /// Vets a peer once at registration. Refuse with [`PlanError::refuse`], naming the field.
    fn check_peer(&self, me: &RankInfo, peer: &RankInfo) -> Result<(), PlanError>;

    /// The peer ranks this rank exchanges with for the peer's DP group `peer_dp_rank`.
    fn targets(
        &self,
        me: &RankInfo,
        peer: &RankInfo,
        peer_dp_rank: u32,
    ) -> Result<PeerTargets, PlanError>;

    /// Sender side: the fragments this rank writes into `peer` for one piece of a request,
    /// computed from the rows each side described.
    fn pair(
        &self,
        me: &RankInfo,
        peer: &RankInfo,
        my_rows: &[LayerGroupRows],
        peer_rows: &[LayerGroupRows],
        request: &PairRequest,
    ) -> Result<TransferPlan, PlanError>;

    /// Receiver side: bytes beyond the paged blocks that ride the same write (recurrent
    /// state), used to size a bounce reservation. `slot_tables` are the receiver's own.
    fn receiver_payload_bytes(
        &self,
        me: &RankInfo,
        peer: &RankInfo,
        slot_tables: &[SlotTable],
    ) -> Result<u64, PlanError> {
        let _ = (me, peer, slot_tables);
        Ok(0)
    }

    /// Drops every cache kept for `peer`.
    fn forget_peer(&self, peer: &RankInfo) {
        let _ = peer;
    }

    /// Sender side, compressed: the same fragments as [`pair`](Self::pair), as patterns of
    /// fragments applied to pairs of rows ([`CompressedPlan`]). The host asks this first and
    /// calls `pair` only when it answers `Ok(None)`, the default: implement it when the plan
    /// repeats one pattern per pair of rows, and let `pair` return its
    /// [`CompressedPlan::expand`]ed form so the two never disagree.
    ///
    /// Added in 0.2.1; a planner built against 0.2.0 gets the default.
    fn pair_compressed(
        &self,
        me: &RankInfo,
        peer: &RankInfo,
        my_rows: &[LayerGroupRows],
        peer_rows: &[LayerGroupRows],
        request: &PairRequest,
    ) -> Result<Option<CompressedPlan>, PlanError> {
        let _ = (me, peer, my_rows, peer_rows, request);
        Ok(None)
    }
}

/// What makes a [`TransferPlanner`] a plugin: its identity and its constructor.
///
/// Export it with [`export_planner!`](crate::export_planner).
pub trait PlannerPlugin: TransferPlanner + Sized + 'static {
    /// The id both sides must agree on, e.g. `acme.llama_gqa`. Use a dotted, vendor-prefixed
    /// name; `kvferry.` is reserved for planners shipped with kvferry.
    const PLANNER_ID: &'static str;

    /// The describer this planner's rows come from. Only
    /// [`DEFAULT_DESCRIBER_ID`](crate::DEFAULT_DESCRIBER_ID) exists today.
    const DESCRIBER_ID: &'static str = crate::DEFAULT_DESCRIBER_ID;

    /// How specific the planner is, for automatic selection (`planner = "auto"`): among the
    /// planners that support a deployment, the host binds the most specific one, and refuses
    /// to guess between two of equal specificity. See [`Specificity`] for the levels.
    const SPECIFICITY: Specificity;

    /// Whether the planner can plan for this deployment; `Err` names the deciding field, the
    /// value found, what is supported and why ([`DeploymentRefusal::new`]).
    // Four strings: called once per bind, never on a hot path, and a plain struct is what an
    // author should be able to return.
    #[allow(clippy::result_large_err)]
    fn supports_deployment(deployment: &Deployment) -> Result<(), DeploymentRefusal>;

    /// Builds the planner for one rank.
    fn new(me: &RankInfo) -> Result<Self, PlanError>;
}

/// The FFI-safe form of [`TransferPlanner`], called through a vtable across the plugin
/// boundary. Planner authors never implement it: [`export_planner!`](crate::export_planner)
/// wraps their planner, catching every panic.
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

    /// See [`TransferPlanner::pair_compressed`]. Appended after the last prefix field in
    /// 0.2.1: a library built against 0.2.0 has no entry for it in its vtable, and this body
    /// answers in its place (no compressed plan, so the host calls `pair`).
    fn pair_compressed(
        &self,
        me: &RankInfo,
        peer: &RankInfo,
        my_rows: RSlice<'_, LayerGroupRows>,
        peer_rows: RSlice<'_, LayerGroupRows>,
        request: &PairRequest,
    ) -> RResult<ROption<CompressedPlan>, PlanError> {
        let _ = (me, peer, my_rows, peer_rows, request);
        RResult::ROk(ROption::RNone)
    }
}

/// A planner behind the FFI boundary, as `new_planner` returns it.
pub type PlannerBox = FfiPlanner_TO<'static, RBox<()>>;

/// Text of a caught panic payload.
pub(crate) fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// Runs `f`, turning a panic into a `PANICKED` [`PlanError`] naming `what`.
pub(crate) fn guard<R>(
    what: &str,
    f: impl FnOnce() -> Result<R, PlanError>,
) -> RResult<R, PlanError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result.into(),
        Err(payload) => {
            let message = panic_message(&*payload);
            // Dropping the payload runs foreign drop code; a second panic there must not
            // unwind into the FFI frame either.
            let _ = catch_unwind(AssertUnwindSafe(move || drop(payload)));
            RResult::RErr(PlanError::panicked(format!("{what} panicked: {message}")))
        }
    }
}

/// Wraps a [`TransferPlanner`] as an [`FfiPlanner`], catching every panic.
#[derive(Debug)]
pub(crate) struct Exported<T>(pub(crate) T);

impl<T: TransferPlanner> FfiPlanner for Exported<T> {
    fn describe(&self) -> RResult<RVec<u8>, PlanError> {
        guard("describe", || self.0.describe().map(RVec::from))
    }

    fn check_peer(&self, me: &RankInfo, peer: &RankInfo) -> RResult<(), PlanError> {
        guard("check_peer", || self.0.check_peer(me, peer))
    }

    fn targets(
        &self,
        me: &RankInfo,
        peer: &RankInfo,
        peer_dp_rank: u32,
    ) -> RResult<PeerTargets, PlanError> {
        guard("targets", || self.0.targets(me, peer, peer_dp_rank))
    }

    fn pair(
        &self,
        me: &RankInfo,
        peer: &RankInfo,
        my_rows: RSlice<'_, LayerGroupRows>,
        peer_rows: RSlice<'_, LayerGroupRows>,
        request: &PairRequest,
    ) -> RResult<TransferPlan, PlanError> {
        guard("pair", || {
            self.0
                .pair(me, peer, my_rows.as_slice(), peer_rows.as_slice(), request)
        })
    }

    fn receiver_payload_bytes(
        &self,
        me: &RankInfo,
        peer: &RankInfo,
        slot_tables: RSlice<'_, SlotTable>,
    ) -> RResult<u64, PlanError> {
        guard("receiver_payload_bytes", || {
            self.0
                .receiver_payload_bytes(me, peer, slot_tables.as_slice())
        })
    }

    fn forget_peer(&self, peer: &RankInfo) -> RResult<(), PlanError> {
        guard("forget_peer", || {
            self.0.forget_peer(peer);
            Ok(())
        })
    }

    fn pair_compressed(
        &self,
        me: &RankInfo,
        peer: &RankInfo,
        my_rows: RSlice<'_, LayerGroupRows>,
        peer_rows: RSlice<'_, LayerGroupRows>,
        request: &PairRequest,
    ) -> RResult<ROption<CompressedPlan>, PlanError> {
        guard("pair_compressed", || {
            self.0
                .pair_compressed(me, peer, my_rows.as_slice(), peer_rows.as_slice(), request)
                .map(ROption::from)
        })
    }
}

/// A planner instance obtained through a loaded module, usable as a [`TransferPlanner`].
pub struct LoadedPlanner {
    inner: PlannerBox,
}

impl std::fmt::Debug for LoadedPlanner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedPlanner").finish_non_exhaustive()
    }
}

impl LoadedPlanner {
    pub(crate) fn new(inner: PlannerBox) -> Self {
        Self { inner }
    }
}

/// The [`TransferPlanner`] methods a loaded planner forwards to its vtable (`self.inner`),
/// whichever interface version that vtable has: shared by [`LoadedPlanner`] and the 0.2.0
/// one in `legacy`.
macro_rules! forward_to_vtable {
    () => {
        fn describe(&self) -> Result<Vec<u8>, PlanError> {
            self.inner.describe().into_result().map(RVec::into_vec)
        }

        fn check_peer(&self, me: &RankInfo, peer: &RankInfo) -> Result<(), PlanError> {
            self.inner.check_peer(me, peer).into_result()
        }

        fn targets(
            &self,
            me: &RankInfo,
            peer: &RankInfo,
            peer_dp_rank: u32,
        ) -> Result<PeerTargets, PlanError> {
            self.inner.targets(me, peer, peer_dp_rank).into_result()
        }

        fn pair(
            &self,
            me: &RankInfo,
            peer: &RankInfo,
            my_rows: &[LayerGroupRows],
            peer_rows: &[LayerGroupRows],
            request: &PairRequest,
        ) -> Result<TransferPlan, PlanError> {
            self.inner
                .pair(
                    me,
                    peer,
                    RSlice::from_slice(my_rows),
                    RSlice::from_slice(peer_rows),
                    request,
                )
                .into_result()
        }

        fn receiver_payload_bytes(
            &self,
            me: &RankInfo,
            peer: &RankInfo,
            slot_tables: &[SlotTable],
        ) -> Result<u64, PlanError> {
            self.inner
                .receiver_payload_bytes(me, peer, RSlice::from_slice(slot_tables))
                .into_result()
        }

        fn forget_peer(&self, peer: &RankInfo) {
            // A panic inside forget_peer has already been caught and reported as an error; the
            // caches it failed to drop are the planner's own concern.
            let _ = self.inner.forget_peer(peer);
        }
    };
}
pub(crate) use forward_to_vtable;

impl TransferPlanner for LoadedPlanner {
    forward_to_vtable!();

    fn pair_compressed(
        &self,
        me: &RankInfo,
        peer: &RankInfo,
        my_rows: &[LayerGroupRows],
        peer_rows: &[LayerGroupRows],
        request: &PairRequest,
    ) -> Result<Option<CompressedPlan>, PlanError> {
        self.inner
            .pair_compressed(
                me,
                peer,
                RSlice::from_slice(my_rows),
                RSlice::from_slice(peer_rows),
                request,
            )
            .into_result()
            .map(ROption::into_option)
    }
}
