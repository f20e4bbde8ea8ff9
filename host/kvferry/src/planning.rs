//! Planning without moving bytes: kvferry's planners for an engine that moves the KV cache
//! with another transfer layer (NIXL, Mooncake's Transfer Engine, its own copy loop).
//!
//! A [`PairPlanner`] is built from the two configurations the agents of a (prefill rank,
//! decode rank) pair would read: it binds each side's planner as the agent does, lets each
//! planner describe its rank and vet the other, and asks whether the prefill rank writes the
//! decode rank at all (the planner's `targets`). [`PairPlanner::plan`] then plans one piece of
//! a request from the two sides' slot tables and validates it by the same rules the agent
//! applies before a byte moves ([`kvferry_plan`]): the answer is a [`ValidatedPlan`], whose
//! [`patterns`](ValidatedPlan::patterns) (compressed) or
//! [`fragments`](ValidatedPlan::fragments) (flat) are absolute addresses in the two ranks'
//! pools as the configurations declare them.
//!
//! Nothing here connects, registers memory or starts a thread. Planner calls run on the
//! caller's thread without the agent's deadline: a planner that hangs hangs the call.

use std::sync::Arc;

use kvferry_loader::BoundPlanner;
pub use kvferry_plan::{Fragments, Pattern, ValidatedPlan};
use kvferry_plan::{PlanFailure, RequestSide};
use kvferry_planner_abi::ffi::{ROption, RVec};
use kvferry_planner_abi::{PairRequest, RankInfo, SlotTable, TokenRange, TransferPlanner, ViewId};
use kvferry_transfer::Role;

use crate::config::{ConfigError, RankConfig, error_chain, parse_rank};

/// Why a [`PairPlanner`] could not be built or a piece not planned.
#[derive(Debug)]
#[non_exhaustive]
pub enum PlanningError {
    /// A configuration was refused, or its planner could not be bound.
    Config {
        /// `prefill` or `decode`: whose configuration.
        side: &'static str,
        /// Why.
        error: ConfigError,
    },
    /// A planner refused (to start on its rank, to describe it, the other rank, the
    /// request) or a plan broke a rule: the message names which step.
    Planner(String),
    /// The request is not one this pair can plan (slot tables, tokens, views).
    Invalid(String),
}

impl std::fmt::Display for PlanningError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PlanningError::Config { side, error } => write!(f, "{side} configuration: {error}"),
            PlanningError::Planner(m) | PlanningError::Invalid(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for PlanningError {}

/// One piece of a request, as the engine that moves it knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The prefill rank's slot tables, one per layer group of its page table.
    pub prefill_tables: Vec<SlotTable>,
    /// The decode rank's slot tables, one per layer group of its page table.
    pub decode_tables: Vec<SlotTable>,
    /// The tokens this piece moves (a chunk of the prompt, or all of it).
    pub tokens: TokenRange,
    /// The prompt's length.
    pub prompt_len: u64,
    /// Where the decode side's copy starts, when it already holds a prefix (prefix caching):
    /// tokens before it are not written.
    pub dst_start_token: Option<u64>,
    /// Layer-wise: the prefill rank's views this piece carries (`None`: every view).
    pub views: Option<Vec<ViewId>>,
}

/// kvferry's planner for one (prefill rank, decode rank) pair, without an agent: see the
/// module docs.
pub struct PairPlanner {
    prefill: RankInfo,
    decode: RankInfo,
    /// The prefill rank's planner instance: the writer plans.
    planner: Arc<dyn TransferPlanner>,
    planner_id: String,
    writes: bool,
    /// The planners' libraries stay loaded while their instances live.
    _bound: [BoundPlanner; 2],
}

impl std::fmt::Debug for PairPlanner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PairPlanner")
            .field("prefill", &self.prefill.peer_key())
            .field("decode", &self.decode.peer_key())
            .field("planner", &self.planner_id)
            .field("writes", &self.writes)
            .finish_non_exhaustive()
    }
}

impl PairPlanner {
    /// Binds and starts both sides' planners from their configurations (the JSON an agent
    /// reads, `role` `context` and `generation`; secrets and transport settings are not
    /// needed), and has each vet the other rank, as two agents do when they connect.
    ///
    /// # Errors
    ///
    /// A configuration refused or of the wrong role, the two sides binding different
    /// planners, or a planner refusing its rank or the other.
    pub fn new(prefill_config: &str, decode_config: &str) -> Result<Self, PlanningError> {
        let (prefill, prefill_bound, prefill_planner) =
            side(prefill_config, "prefill", Role::Prefill)?;
        let (decode, decode_bound, decode_planner) = side(decode_config, "decode", Role::Decode)?;
        if prefill.planner_id != decode.planner_id || prefill.describer_id != decode.describer_id {
            return Err(PlanningError::Planner(format!(
                "the prefill side binds planner {} (describer {}), the decode side {} \
                 (describer {}): both sides must bind the same planner",
                prefill.planner_id, prefill.describer_id, decode.planner_id, decode.describer_id
            )));
        }
        let id = prefill.planner_id.to_string();
        let refused = |who: &str, e: &dyn std::error::Error| {
            PlanningError::Planner(format!(
                "planner {id} on the {who} rank refuses the other rank: {}",
                error_chain(e)
            ))
        };
        prefill_planner
            .check_peer(&prefill, &decode)
            .map_err(|e| refused("prefill", &e))?;
        decode_planner
            .check_peer(&decode, &prefill)
            .map_err(|e| refused("decode", &e))?;
        let targets = prefill_planner
            .targets(&prefill, &decode, decode.dp_rank)
            .map_err(|e| {
                PlanningError::Planner(format!(
                    "planner {id}: which decode ranks the prefill rank writes: {}",
                    error_chain(&e)
                ))
            })?;
        let writes = targets.ranks.contains(&decode.instance_rank);
        Ok(Self {
            prefill,
            decode,
            planner: prefill_planner,
            planner_id: id,
            writes,
            _bound: [prefill_bound, decode_bound],
        })
    }

    /// Whether the prefill rank writes the decode rank at all (the planner's `targets` for
    /// the decode rank's DP group). A pair it does not write has nothing to plan.
    pub fn writes(&self) -> bool {
        self.writes
    }

    /// The bound planner's id.
    pub fn planner_id(&self) -> &str {
        &self.planner_id
    }

    /// The prefill rank's description, as its agent would advertise it.
    pub fn prefill(&self) -> &RankInfo {
        &self.prefill
    }

    /// The decode rank's description, as its agent would advertise it.
    pub fn decode(&self) -> &RankInfo {
        &self.decode
    }

    /// Plans `piece` from the prefill rank to the decode rank and validates the plan: every
    /// source inside the prefill rank's rows for the request, every destination inside the
    /// decode rank's, no destination written twice.
    ///
    /// # Errors
    ///
    /// A pair the prefill rank does not write, tokens or views the request cannot have, a
    /// slot outside its pool, or the planner's refusal or broken plan (naming the step).
    pub fn plan(&self, piece: &Piece) -> Result<ValidatedPlan, PlanningError> {
        if !self.writes {
            return Err(PlanningError::Invalid(format!(
                "{} rank {} does not write {} rank {} (planner {}'s targets leave it out)",
                self.prefill.instance_name,
                self.prefill.instance_rank,
                self.decode.instance_name,
                self.decode.instance_rank,
                self.planner_id
            )));
        }
        let t = piece.tokens;
        if piece.prompt_len == 0 || t.start >= t.end || t.end > piece.prompt_len {
            return Err(PlanningError::Invalid(format!(
                "tokens {}..{} of a {}-token prompt",
                t.start, t.end, piece.prompt_len
            )));
        }
        if piece.dst_start_token.is_some_and(|s| s > piece.prompt_len) {
            return Err(PlanningError::Invalid(format!(
                "dst_start_token {} is past the {}-token prompt",
                piece.dst_start_token.unwrap_or_default(),
                piece.prompt_len
            )));
        }
        let excluded = match piece.views.as_deref() {
            None => Vec::new(),
            Some(views) => kvferry_plan::excluded_views(&self.prefill, views)
                .map_err(|e| PlanningError::Invalid(format!("the prefill side: {e}")))?,
        };
        // Both sides' tables cover the piece's tokens (a short table would plan a partial
        // piece that looks whole to whatever moves it).
        for (side, info, tables, excluded) in [
            (
                "prefill",
                &self.prefill,
                &piece.prefill_tables,
                &excluded[..],
            ),
            ("decode", &self.decode, &piece.decode_tables, &[][..]),
        ] {
            kvferry_plan::check_slot_tables(info, tables, excluded, t.end)
                .map_err(|e| PlanningError::Invalid(format!("the {side} side: {e}")))?;
        }
        let request = PairRequest {
            token_range: t,
            prompt_len: piece.prompt_len,
            dst_start_token: match piece.dst_start_token {
                Some(s) => ROption::RSome(s),
                None => ROption::RNone,
            },
            is_last: t.end == piece.prompt_len,
        };
        let me = RequestSide {
            info: &self.prefill,
            slot_tables: &piece.prefill_tables,
            excluded: &excluded,
        };
        let them = RequestSide::new(&self.decode, &piece.decode_tables);
        kvferry_plan::plan_transfer(self.planner.as_ref(), me, them, &request).map_err(|e| {
            let text = error_chain(&e);
            match e {
                // Slot tables the describer refuses are the request's fault, not the planner's.
                PlanFailure::DescribeLocal(_) => {
                    PlanningError::Invalid(format!("the prefill side: {text}"))
                }
                PlanFailure::DescribePeer(_) => {
                    PlanningError::Invalid(format!("the decode side: {text}"))
                }
                _ => PlanningError::Planner(format!("planner {}: {text}", self.planner_id)),
            }
        })
    }
}

/// One side: its configuration parsed and of `role`, its planner bound and started on it,
/// and the description its agent would advertise (planner id, describer, blob).
fn side(
    text: &str,
    name: &'static str,
    role: Role,
) -> Result<(RankInfo, BoundPlanner, Arc<dyn TransferPlanner>), PlanningError> {
    let config = |error| PlanningError::Config { side: name, error };
    let RankConfig {
        role: found,
        mut rank,
        binding,
    } = parse_rank(text).map_err(config)?;
    if found != role {
        return Err(PlanningError::Invalid(format!(
            "the {name} configuration's role is {found}, not {role}"
        )));
    }
    let bound = binding.bind().map_err(config)?;
    rank.planner_id = bound.id().into();
    rank.describer_id = bound.describer_id().into();
    let planner = bound.instantiate(&rank).map_err(|e| {
        PlanningError::Planner(format!(
            "planner {} cannot start on the {name} rank: {}",
            bound.id(),
            error_chain(&e)
        ))
    })?;
    rank.planner_blob = RVec::from(planner.describe().map_err(|e| {
        PlanningError::Planner(format!(
            "planner {} cannot describe the {name} rank: {}",
            bound.id(),
            error_chain(&e)
        ))
    })?);
    Ok((rank, bound, planner))
}
