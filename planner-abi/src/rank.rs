//! What a rank advertises to its peers, and the deployment a planner is bound to.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use abi_stable::StableAbi;
use abi_stable::std_types::{RString, RVec};
use serde::{Deserialize, Serialize};

use crate::PageTable;

/// One rank's self-description, exchanged with peers at registration.
///
/// Host-only facts (worker address, remote keys, endpoints) travel beside it, not in it.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankInfo {
    /// The instance (prefill or decode server) this rank belongs to.
    pub instance_name: RString,
    /// Global rank inside the instance.
    pub instance_rank: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// Tensor-parallel rank.
    pub tp_rank: u32,
    /// Pipeline-parallel size.
    pub pp_size: u32,
    /// Pipeline-parallel rank.
    pub pp_rank: u32,
    /// Context-parallel size (helix on the decode side).
    pub cp_size: u32,
    /// Context-parallel rank.
    pub cp_rank: u32,
    /// Data-parallel size; equals `tp_size` under attention DP.
    pub dp_size: u32,
    /// Data-parallel rank; equals `tp_rank` under attention DP.
    pub dp_rank: u32,
    /// Whether attention runs data-parallel (every TP rank serves its own requests).
    pub attention_dp: bool,
    /// Layers held by each PP stage, indexed by PP rank.
    pub layers_per_pp: RVec<u32>,
    /// This rank's cache.
    pub page_table: PageTable,
    /// Id of the planner bound on this rank.
    pub planner_id: RString,
    /// Id of the describer that turns slot tables into rows on this rank.
    pub describer_id: RString,
    /// The planner's opaque self-description ([`crate::TransferPlanner::describe`]).
    pub planner_blob: RVec<u8>,
}

impl RankInfo {
    /// Rank `instance_rank` of an instance laid out as `mapping` (its coordinates from
    /// [`Mapping::coords`]; under attention DP its DP rank is its TP rank), holding
    /// `layers_per_pp[p]` layers on PP stage `p` and the cache `page_table`. It names no
    /// planner (the host fills in the one it binds; [`with_planner`](Self::with_planner)
    /// sets one), uses the [default describer](crate::DEFAULT_DESCRIBER_ID) and carries no
    /// planner blob.
    ///
    /// ```
    /// # use kvferry_planner_abi::{Mapping, PageTable, RankInfo};
    /// let mapping: Mapping = "tp4pp2".parse().unwrap();
    /// let table = PageTable { tokens_per_block: 32, pools: vec![].into(), groups: vec![].into() };
    /// let rank = RankInfo::new("ctx-0", &mapping, 5, vec![40, 40], table);
    /// assert_eq!((rank.pp_rank, rank.tp_rank), (1, 1));
    /// assert_eq!(rank.pp_layer_range(), 40..80);
    /// ```
    pub fn new(
        instance_name: impl Into<RString>,
        mapping: &Mapping,
        instance_rank: u32,
        layers_per_pp: impl Into<RVec<u32>>,
        page_table: PageTable,
    ) -> Self {
        let at = mapping.coords(instance_rank);
        let (dp_size, dp_rank) = if mapping.attention_dp {
            (mapping.tp, at.tp)
        } else {
            (1, 0)
        };
        Self {
            instance_name: instance_name.into(),
            instance_rank,
            tp_size: mapping.tp,
            tp_rank: at.tp,
            pp_size: mapping.pp,
            pp_rank: at.pp,
            cp_size: mapping.cp,
            cp_rank: at.cp,
            dp_size,
            dp_rank,
            attention_dp: mapping.attention_dp,
            layers_per_pp: layers_per_pp.into(),
            page_table,
            planner_id: RString::new(),
            describer_id: RString::from(crate::DEFAULT_DESCRIBER_ID),
            planner_blob: RVec::new(),
        }
    }

    /// The same rank, naming `planner_id` as the planner bound on it.
    pub fn with_planner(mut self, planner_id: impl Into<RString>) -> Self {
        self.planner_id = planner_id.into();
        self
    }

    /// The same rank, naming `describer_id` as its describer.
    pub fn with_describer(mut self, describer_id: impl Into<RString>) -> Self {
        self.describer_id = describer_id.into();
        self
    }

    /// The same rank, carrying `blob` as its planner's self-description.
    pub fn with_planner_blob(mut self, blob: impl Into<RVec<u8>>) -> Self {
        self.planner_blob = blob.into();
        self
    }

    /// DP groups of the instance: `dp_size` under attention DP, else 1 (the instance serves
    /// each request on every rank).
    pub fn dp_groups(&self) -> u32 {
        if self.attention_dp {
            self.dp_size.max(1)
        } else {
            1
        }
    }

    /// TP size inside one DP group: 1 under attention DP, else `tp_size`.
    pub fn tp_per_dp(&self) -> u32 {
        if self.attention_dp {
            (self.tp_size / self.dp_size.max(1)).max(1)
        } else {
            self.tp_size
        }
    }

    /// TP rank inside the DP group.
    pub fn tp_rank_in_dp(&self) -> u32 {
        self.tp_rank % self.tp_per_dp()
    }

    /// The global layer indices this rank's PP stage holds: `[Σ n_p for p < pp_rank, + n)`.
    pub fn pp_layer_range(&self) -> Range<u64> {
        let start: u64 = self
            .layers_per_pp
            .iter()
            .take(self.pp_rank as usize)
            .map(|&n| u64::from(n))
            .sum();
        let n = self
            .layers_per_pp
            .get(self.pp_rank as usize)
            .map_or(0, |&n| u64::from(n));
        start..start + n
    }

    /// Total layers over all PP stages.
    pub fn total_layers(&self) -> u64 {
        self.layers_per_pp.iter().map(|&n| u64::from(n)).sum()
    }

    /// The key a peer is cached under: instance name and rank.
    pub fn peer_key(&self) -> (String, u32) {
        (self.instance_name.to_string(), self.instance_rank)
    }
}

/// The parallel mapping of a deployment.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mapping {
    /// Tensor-parallel size (also the DP width under attention DP).
    pub tp: u32,
    /// Pipeline-parallel size.
    pub pp: u32,
    /// Context-parallel size.
    pub cp: u32,
    /// MoE tensor-parallel size.
    pub moe_tp: u32,
    /// MoE expert-parallel size.
    pub moe_ep: u32,
    /// Attention data parallelism.
    pub attention_dp: bool,
}

/// Where a rank sits in its instance's [`Mapping`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RankCoords {
    /// Pipeline stage.
    pub pp: u32,
    /// Tensor-parallel rank.
    pub tp: u32,
    /// Context-parallel rank.
    pub cp: u32,
}

impl Mapping {
    /// One rank: no tensor, pipeline, context or expert parallelism, no attention DP.
    pub const SINGLE: Mapping = Mapping {
        tp: 1,
        pp: 1,
        cp: 1,
        moe_tp: 1,
        moe_ep: 1,
        attention_dp: false,
    };

    /// The coordinates of instance rank `rank`. Ranks run CP fastest, then TP, then PP:
    /// `rank = (pp · tp_size + tp) · cp_size + cp`, the numbering every kvferry host and
    /// planner uses ([`rank_at`](Self::rank_at) is the inverse).
    pub fn coords(&self, rank: u32) -> RankCoords {
        let cp = self.cp.max(1);
        let per_stage = self.tp.max(1) * cp;
        RankCoords {
            pp: rank / per_stage,
            tp: rank % per_stage / cp,
            cp: rank % cp,
        }
    }

    /// The instance rank at `coords` (the inverse of [`coords`](Self::coords)).
    pub fn rank_at(&self, coords: RankCoords) -> u32 {
        (coords.pp * self.tp + coords.tp) * self.cp + coords.cp
    }

    /// Ranks in one instance.
    pub fn world_size(&self) -> u32 {
        self.tp * self.pp * self.cp
    }

    /// DP groups: `tp` under attention DP (each TP rank serves its own requests), else 1.
    pub fn dp_groups(&self) -> u32 {
        if self.attention_dp { self.tp } else { 1 }
    }
}

impl fmt::Display for Mapping {
    /// The shorthand serving engineers use: `tp4pp2`, `dep8`, `tp2cp4`, `dep8ep8`.
    /// [`Mapping::from_str`] reads it back (MoE TP is always `tp / ep` in a valid mapping).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.attention_dp {
            write!(f, "dep{}", self.tp)?;
        } else {
            write!(f, "tp{}", self.tp)?;
        }
        if self.pp > 1 {
            write!(f, "pp{}", self.pp)?;
        }
        if self.cp > 1 {
            write!(f, "cp{}", self.cp)?;
        }
        if self.moe_ep > 1 {
            write!(f, "ep{}", self.moe_ep)?;
        }
        Ok(())
    }
}

/// Why a deployment shorthand could not be read as a [`Mapping`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MappingParseError {
    spec: String,
    reason: String,
}

impl MappingParseError {
    /// The text that was parsed.
    pub fn spec(&self) -> &str {
        &self.spec
    }

    /// What is wrong with it.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for MappingParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid deployment {:?}: {}", self.spec, self.reason)
    }
}

impl std::error::Error for MappingParseError {}

impl FromStr for Mapping {
    type Err = MappingParseError;

    /// Reads the serving shorthand: a sequence of `<axis><size>` terms, `tp` (tensor
    /// parallel), `dep` (attention data parallel over that many ranks: `tp` with attention
    /// DP), `pp`, `cp`, `ep` (MoE expert parallel) and `moetp`, case-insensitive. Each axis
    /// may appear once; `tp` and `dep` exclude each other. Unset axes are 1, except MoE TP,
    /// which defaults to `tp / ep`. `tp4`, `tp4pp2`, `tp2cp4`, `dep8`, `dep8ep8`.
    fn from_str(spec: &str) -> Result<Self, MappingParseError> {
        let fail = |reason: String| MappingParseError {
            spec: spec.to_string(),
            reason,
        };
        let lower = spec.trim().to_ascii_lowercase();
        if lower.is_empty() {
            return Err(fail("empty (try tp4, dep8, tp4pp2, tp2cp4)".into()));
        }
        let (mut tp, mut dep, mut pp, mut cp, mut ep, mut moe_tp) =
            (None, None, None, None, None, None);
        let mut rest = lower.as_str();
        while !rest.is_empty() {
            let name_len = rest
                .find(|c: char| c.is_ascii_digit())
                .ok_or_else(|| fail(format!("{rest:?} has no size")))?;
            let (name, after) = rest.split_at(name_len);
            let digits = after
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(after.len());
            let (number, tail) = after.split_at(digits);
            // Only digits reach here: the one way to fail is a size past u32.
            let size: u32 = number.parse().map_err(|_| {
                fail(format!(
                    "size {number} of {name} is too large (at most {})",
                    u32::MAX
                ))
            })?;
            if size == 0 {
                return Err(fail(format!("{name} size is 0")));
            }
            let slot = match name {
                "tp" => &mut tp,
                "dep" => &mut dep,
                "pp" => &mut pp,
                "cp" => &mut cp,
                "ep" => &mut ep,
                "moetp" => &mut moe_tp,
                other => {
                    return Err(fail(format!(
                        "unknown axis {other:?} (known: tp, dep, pp, cp, ep, moetp)"
                    )));
                }
            };
            if slot.replace(size).is_some() {
                return Err(fail(format!("{name} given twice")));
            }
            rest = tail;
        }
        if tp.is_some() && dep.is_some() {
            return Err(fail(
                "tp and dep both given (dep N is tp N with attention DP)".into(),
            ));
        }
        let attention_dp = dep.is_some();
        let tp = dep.or(tp).unwrap_or(1);
        let moe_ep = ep.unwrap_or(1);
        let moe_tp = match moe_tp {
            Some(m) => m,
            None if tp % moe_ep == 0 => tp / moe_ep,
            None => return Err(fail(format!("ep {moe_ep} does not divide tp {tp}"))),
        };
        if moe_tp.checked_mul(moe_ep) != Some(tp) {
            return Err(fail(format!(
                "moetp {moe_tp} × ep {moe_ep} must equal the tp width {tp}"
            )));
        }
        Ok(Mapping {
            tp,
            pp: pp.unwrap_or(1),
            cp: cp.unwrap_or(1),
            moe_tp,
            moe_ep,
            attention_dp,
        })
    }
}

/// What a planner is asked to support at bind time: architecture plus mapping.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deployment {
    /// The model architecture as named by its config, e.g. `DeepseekV3ForCausalLM`.
    pub architecture: RString,
    /// The parallel mapping.
    pub mapping: Mapping,
}

impl fmt::Display for Deployment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.architecture, self.mapping)
    }
}

/// How specific a planner is: the rule automatic selection (`planner = "auto"`) orders
/// planners by. Among the loaded planners whose `supports_deployment` accepts a deployment,
/// the host binds the one with the highest specificity; two at the same highest value are an
/// error naming both, never a guess.
///
/// Pick the level that says what the planner's `supports_deployment` restricts:
///
/// | level | the planner accepts | example |
/// |---|---|---|
/// | [`GENERIC`](Self::GENERIC) | any architecture | `kvferry.default` |
/// | [`ARCHITECTURE`](Self::ARCHITECTURE) | one model family's architecture names, any mapping | a Llama GQA planner |
/// | [`DEPLOYMENT`](Self::DEPLOYMENT) | one architecture, restricted mappings | `kvferry.deepseek_mla_latent` (attention DP, pp = cp = 1) |
///
/// Values between the levels are allowed for a finer order (a planner that narrows another
/// one's deployments declares a higher value than it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Specificity(pub u32);

impl Specificity {
    /// Plans for any architecture.
    pub const GENERIC: Self = Self(0);
    /// Plans for one architecture (model family), any mapping.
    pub const ARCHITECTURE: Self = Self(100);
    /// Plans for one architecture under restricted mappings.
    pub const DEPLOYMENT: Self = Self(200);

    /// The level's name (`generic`, `architecture`, `deployment`), or the number between.
    pub fn name(self) -> String {
        match self {
            Self::GENERIC => "generic".into(),
            Self::ARCHITECTURE => "architecture".into(),
            Self::DEPLOYMENT => "deployment".into(),
            Self(n) => n.to_string(),
        }
    }
}

impl fmt::Display for Specificity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}
