//! Whose view is "mine" in a direction-agnostic check, and refusals put in this rank's
//! perspective.
//!
//! The peer check vets both matching directions (this rank's views against the peer's, and
//! the peer's against this rank's); [`Side`] lets one routine serve both while every refusal
//! still reports this rank's value as `ours`.

use std::fmt::Display;

use kvferry_planner_abi::PlanError;

/// Whose view is "mine" in a direction-agnostic check: refusals always report this rank's
/// value as `ours`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    /// "Mine" is this rank's view.
    Local,
    /// "Mine" is the peer's view (the reverse matching direction).
    Peer,
}

impl Side {
    /// A refusal of `field`, with `mine` and `theirs` put in this rank's perspective.
    pub(crate) fn refuse(
        self,
        field: &str,
        mine: impl Display,
        theirs: impl Display,
        reason: impl Into<String>,
    ) -> PlanError {
        match self {
            Side::Local => PlanError::refuse(field, mine, theirs, reason),
            Side::Peer => PlanError::refuse(field, theirs, mine, reason),
        }
    }

    /// `ours <a>, theirs <b>` in this rank's perspective.
    pub(crate) fn between(self, mine: &str, theirs: &str) -> String {
        match self {
            Side::Local => format!("ours {mine}, theirs {theirs}"),
            Side::Peer => format!("ours {theirs}, theirs {mine}"),
        }
    }
}
