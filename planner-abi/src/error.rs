//! Errors that cross the planner boundary.

use std::fmt;

use abi_stable::StableAbi;
use abi_stable::std_types::{RBox, ROption, RString};
use serde::{Deserialize, Serialize};

/// What kind of failure a [`PlanError`] reports.
///
/// An open set of codes rather than a Rust enum: a host built against a newer `planner-abi`
/// may receive a code from an older planner and vice versa, and an unknown code must still be
/// representable (abi_stable refuses enums whose variant count differs between the two sides).
/// Consumers treat unknown codes as [`ErrorKind::OTHER`].
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ErrorKind(pub u32);

impl ErrorKind {
    /// The input handed to the planner (rank description, rows, slot table, request) is
    /// malformed or inconsistent.
    pub const INVALID_INPUT: Self = Self(1);
    /// The peer cannot exchange KV cache with this rank; see [`PlanError::refusal`].
    pub const PEER_INCOMPATIBLE: Self = Self(2);
    /// The planner does not support the deployment or request it was given.
    pub const UNSUPPORTED: Self = Self(3);
    /// The planner panicked; the panic was caught at the boundary.
    pub const PANICKED: Self = Self(4);
    /// Anything else.
    pub const OTHER: Self = Self(5);

    /// A short lowercase name for the kind.
    pub fn name(self) -> &'static str {
        match self {
            Self::INVALID_INPUT => "invalid input",
            Self::PEER_INCOMPATIBLE => "peer incompatible",
            Self::UNSUPPORTED => "unsupported",
            Self::PANICKED => "planner panicked",
            _ => "error",
        }
    }
}

impl fmt::Debug for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}({})", self.name(), self.0)
    }
}

/// Why a peer was refused, down to the field that differs.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerRefusal {
    /// The field that decided the refusal, e.g. `tokens_per_block` or `pp_size`.
    pub field: RString,
    /// This rank's value of the field.
    pub ours: RString,
    /// The peer's value of the field.
    pub theirs: RString,
    /// Why the two values cannot work together.
    pub reason: RString,
}

impl fmt::Display for PeerRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: ours {}, theirs {}: {}",
            self.field, self.ours, self.theirs, self.reason
        )
    }
}

/// Why a planner does not support a deployment, down to the field that decides it.
///
/// Returned by [`PlannerPlugin::supports_deployment`](crate::PlannerPlugin::supports_deployment)
/// and carried across the boundary inside a [`PlanError`] of kind
/// [`ErrorKind::UNSUPPORTED`], so a host can list every planner's verdict field by field
/// (`kvferry check`) instead of only a sentence.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeploymentRefusal {
    /// The deployment field that decides, e.g. `architecture`, `mapping.pp`,
    /// `mapping.attention_dp`.
    pub field: RString,
    /// The deployment's value of the field.
    pub found: RString,
    /// What the planner supports instead, e.g. `DeepseekV3ForCausalLM`, `1`, `true`.
    pub supported: RString,
    /// Why the planner cannot plan for the value found.
    pub reason: RString,
}

impl DeploymentRefusal {
    /// A refusal naming the deciding field, the value found, what is supported and why.
    pub fn new(
        field: impl Into<String>,
        found: impl fmt::Display,
        supported: impl fmt::Display,
        reason: impl Into<String>,
    ) -> Self {
        Self {
            field: RString::from(field.into()),
            found: RString::from(found.to_string()),
            supported: RString::from(supported.to_string()),
            reason: RString::from(reason.into()),
        }
    }
}

impl fmt::Display for DeploymentRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} = {} (supports {}): {}",
            self.field, self.found, self.supported, self.reason
        )
    }
}

/// The field-level detail of a [`PlanError`], boxed behind one pointer.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum Detail {
    Peer(PeerRefusal),
    Deployment(DeploymentRefusal),
}

/// The error every planner entry point returns.
#[repr(C)]
#[derive(StableAbi, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanError {
    kind: ErrorKind,
    message: RString,
    // Boxed so the error stays small on the happy path's Result.
    detail: ROption<RBox<Detail>>,
}

impl PlanError {
    /// An error of `kind` with a message.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: RString::from(message.into()),
            detail: ROption::RNone,
        }
    }

    /// Malformed or inconsistent input.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::INVALID_INPUT, message)
    }

    /// The planner does not support what it was asked to do.
    pub fn unsupported(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::UNSUPPORTED, message)
    }

    /// A caught panic.
    pub fn panicked(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::PANICKED, message)
    }

    /// A peer refusal naming the field, both values and the reason.
    pub fn refuse(
        field: impl Into<String>,
        ours: impl fmt::Display,
        theirs: impl fmt::Display,
        reason: impl Into<String>,
    ) -> Self {
        let refusal = PeerRefusal {
            field: RString::from(field.into()),
            ours: RString::from(ours.to_string()),
            theirs: RString::from(theirs.to_string()),
            reason: RString::from(reason.into()),
        };
        Self {
            kind: ErrorKind::PEER_INCOMPATIBLE,
            message: RString::from(refusal.to_string()),
            detail: ROption::RSome(RBox::new(Detail::Peer(refusal))),
        }
    }

    /// The planner does not support a deployment: [`ErrorKind::UNSUPPORTED`] with the
    /// field-level refusal.
    pub fn unsupported_deployment(refusal: DeploymentRefusal) -> Self {
        Self {
            kind: ErrorKind::UNSUPPORTED,
            message: RString::from(refusal.to_string()),
            detail: ROption::RSome(RBox::new(Detail::Deployment(refusal))),
        }
    }

    /// The kind of failure.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The message, without the kind prefix.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The field-level reason, for [`ErrorKind::PEER_INCOMPATIBLE`].
    pub fn refusal(&self) -> Option<&PeerRefusal> {
        match self.detail.as_ref().into_option().map(|d| &**d) {
            Some(Detail::Peer(r)) => Some(r),
            _ => None,
        }
    }

    /// The field-level reason a deployment is not supported, for errors made by
    /// [`PlanError::unsupported_deployment`].
    pub fn deployment_refusal(&self) -> Option<&DeploymentRefusal> {
        match self.detail.as_ref().into_option().map(|d| &**d) {
            Some(Detail::Deployment(r)) => Some(r),
            _ => None,
        }
    }

    /// Prefix the message with context, keeping kind and refusal.
    pub fn context(mut self, context: impl fmt::Display) -> Self {
        self.message = RString::from(format!("{context}: {}", self.message));
        self
    }
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.name(), self.message)
    }
}

impl fmt::Debug for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PlanError")
            .field("kind", &self.kind)
            .field("message", &self.message.as_str())
            .field("refusal", &self.refusal())
            .field("deployment", &self.deployment_refusal())
            .finish()
    }
}

impl std::error::Error for PlanError {}
