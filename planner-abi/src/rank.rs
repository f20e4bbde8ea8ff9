//! What a rank advertises to its peers, and the deployment a planner is bound to.

use std::fmt;
use std::ops::Range;

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
    /// The instance (context or generation server) this rank belongs to.
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
    /// Context-parallel size (helix on the generation side).
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

impl Mapping {
    /// Ranks in one instance.
    pub fn world_size(&self) -> u32 {
        self.tp * self.pp * self.cp
    }
}

impl fmt::Display for Mapping {
    /// The shorthand serving engineers use: `tp4pp2`, `dep8`, `tp2cp4`, `dep8ep8`.
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
