//! `kvferry.deepseek_mla_latent`: the transfer planner for DeepSeek-V3 MLA caches under
//! attention data parallelism.
//!
//! DeepSeek-V3 caches one 576-element latent per token per layer (`kv_lora_rank` 512 plus
//! `qk_rope_head_dim` 64) in a single PAGED pool: a slot holds `tokens_per_block` tokens of
//! every layer, layers back to back. Under attention DP every rank holds the whole latent
//! for its own requests, so there is nothing to re-shard and no pool matching to do: a
//! request flows from the prefill DP rank to the decode DP rank, slot by slot, and slots
//! that are consecutive in memory on both sides merge into one fragment.
//!
//! It supports `DeepseekV3ForCausalLM` under attention DP with `pp = cp = 1`, at any DP width
//! on either side (dep4 feeds dep8). Everything else — PP, helix CP, a speculative layer on
//! one side only, a second view such as an indexer cache — is the default planner's job;
//! `check_peer` refuses it naming the field.

#![deny(unsafe_code)]
#![deny(missing_docs)]

use kvferry_planner_abi::{
    CompressedPlan, Deployment, DeploymentRefusal, GroupKind, LayerGroupRows, PageTable,
    PairRequest, PeerTargets, PlanError, PlanPattern, PlannerPlugin, RankInfo, Specificity,
    TransferPlan, TransferPlanner, export_planner,
};

/// The architecture this planner serves, as named by the model config.
pub const ARCHITECTURE: &str = "DeepseekV3ForCausalLM";

/// The planner. It keeps no per-peer state: every decision is a function of the two rank
/// descriptions and the rows.
#[derive(Debug)]
pub struct DeepseekMlaLatent {
    tokens_per_block: u32,
    description: Vec<u8>,
}

/// The geometry of the single latent view, as compared between peers.
#[derive(Debug, PartialEq, Eq)]
struct Latent {
    tokens_per_block: u32,
    slot_bytes: u64,
    dtype: String,
    elem_bits: u32,
    roles: Vec<String>,
    /// `(global layer, offset, size)` in slot order.
    layers: Vec<(u32, u64, u64)>,
}

impl Latent {
    /// Reads the latent geometry off a page table, refusing anything that is not exactly one
    /// PAGED group with one unsharded view whose layers tile the slot.
    fn of(table: &PageTable) -> Result<Self, PlanError> {
        let [group] = table.groups.as_slice() else {
            return Err(PlanError::unsupported(format!(
                "the MLA latent planner needs exactly one layer group, found {}",
                table.groups.len()
            )));
        };
        if group.kind != GroupKind::PAGED {
            return Err(PlanError::unsupported(format!(
                "the MLA latent planner needs a PAGED layer group, found {}",
                group.kind
            )));
        }
        if let Some(window) = group.window() {
            return Err(PlanError::unsupported(format!(
                "the MLA latent planner needs full attention, found a window of {window} tokens"
            )));
        }
        let [view] = group.views.as_slice() else {
            return Err(PlanError::unsupported(format!(
                "the MLA latent planner needs exactly one view (the latent), found {}",
                group.views.len()
            )));
        };
        let layout = &view.layout;
        if layout.num_shards != 1 {
            return Err(PlanError::unsupported(format!(
                "the latent is sharded into {} parts; the MLA latent planner needs it whole",
                layout.num_shards
            )));
        }
        let pool = table.pools.get(view.pool as usize).ok_or_else(|| {
            PlanError::invalid(format!(
                "the latent view names pool {}, which does not exist",
                view.pool
            ))
        })?;
        let ranges = view.layer_ranges(group)?;
        let mut end = 0;
        for r in &ranges {
            if r.offset != end {
                return Err(PlanError::unsupported(format!(
                    "latent layer {} starts at offset {} of the slot, not {end}: layers must tile \
                     the slot",
                    r.global, r.offset
                )));
            }
            end = r.offset + r.size;
        }
        if end != pool.slot_bytes {
            return Err(PlanError::unsupported(format!(
                "the latent layers cover {end} of the slot's {} bytes: layers must tile the slot",
                pool.slot_bytes
            )));
        }
        Ok(Self {
            tokens_per_block: table.tokens_per_block,
            slot_bytes: pool.slot_bytes,
            dtype: layout.dtype.to_string(),
            elem_bits: layout.elem_bits,
            roles: view.roles.iter().map(|r| r.to_string()).collect(),
            layers: ranges
                .iter()
                .map(|r| (r.global, r.offset, r.size))
                .collect(),
        })
    }

    /// Refuses a peer whose latent does not line up byte for byte with ours.
    fn check_against(&self, peer: &Latent) -> Result<(), PlanError> {
        if self.tokens_per_block != peer.tokens_per_block {
            return Err(PlanError::refuse(
                "tokens_per_block",
                self.tokens_per_block,
                peer.tokens_per_block,
                "a slot must hold the same tokens on both sides",
            ));
        }
        if self.dtype != peer.dtype || self.elem_bits != peer.elem_bits {
            return Err(PlanError::refuse(
                "dtype",
                format!("{} ({} bits)", self.dtype, self.elem_bits),
                format!("{} ({} bits)", peer.dtype, peer.elem_bits),
                "the latent element type must match",
            ));
        }
        if self.roles != peer.roles {
            return Err(PlanError::refuse(
                "roles",
                self.roles.join(","),
                peer.roles.join(","),
                "the latent view must carry the same roles",
            ));
        }
        if self.layers.len() != peer.layers.len() {
            return Err(PlanError::refuse(
                "layer count",
                self.layers.len(),
                peer.layers.len(),
                "the latent planner copies whole slots; use kvferry.default when one side has \
                 extra (e.g. MTP) layers",
            ));
        }
        if let Some((ours, theirs)) = self
            .layers
            .iter()
            .zip(&peer.layers)
            .find(|(a, b)| a.0 != b.0)
        {
            return Err(PlanError::refuse(
                "layer ids",
                ours.0,
                theirs.0,
                "slots must hold the same global layers in the same order",
            ));
        }
        if let Some((ours, theirs)) = self.layers.iter().zip(&peer.layers).find(|(a, b)| a != b) {
            return Err(PlanError::refuse(
                format!("layer {} region", ours.0),
                format!("offset {} size {}", ours.1, ours.2),
                format!("offset {} size {}", theirs.1, theirs.2),
                "every layer must sit at the same place in the slot",
            ));
        }
        if self.slot_bytes != peer.slot_bytes {
            return Err(PlanError::refuse(
                "slot_bytes",
                self.slot_bytes,
                peer.slot_bytes,
                "slots must have the same size on both sides",
            ));
        }
        Ok(())
    }
}

/// Refuses a rank whose topology breaks the planner's invariant.
fn check_topology(role: &str, ours: &RankInfo, theirs: &RankInfo) -> Result<(), PlanError> {
    let fields = [
        ("pp_size", ours.pp_size, theirs.pp_size, 1),
        ("cp_size", ours.cp_size, theirs.cp_size, 1),
    ];
    for (field, a, b, want) in fields {
        if a != want || b != want {
            return Err(PlanError::refuse(
                field,
                a,
                b,
                format!("the MLA latent planner needs {field} = {want} on both sides ({role})"),
            ));
        }
    }
    if !ours.attention_dp || !theirs.attention_dp {
        return Err(PlanError::refuse(
            "attention_dp",
            ours.attention_dp,
            theirs.attention_dp,
            "the MLA latent planner needs attention DP on both sides",
        ));
    }
    Ok(())
}

impl TransferPlanner for DeepseekMlaLatent {
    fn describe(&self) -> Result<Vec<u8>, PlanError> {
        Ok(self.description.clone())
    }

    fn check_peer(&self, me: &RankInfo, peer: &RankInfo) -> Result<(), PlanError> {
        check_topology("check_peer", me, peer)?;
        let ours = Latent::of(&me.page_table)?;
        let theirs = Latent::of(&peer.page_table).map_err(|e| {
            PlanError::refuse(
                "page table",
                "one PAGED group with one whole latent view",
                "another layout",
                e.message(),
            )
        })?;
        ours.check_against(&theirs)
    }

    fn targets(
        &self,
        me: &RankInfo,
        peer: &RankInfo,
        peer_dp_rank: u32,
    ) -> Result<PeerTargets, PlanError> {
        check_topology("targets", me, peer)?;
        if peer_dp_rank >= peer.dp_size {
            return Err(PlanError::invalid(format!(
                "peer DP rank {peer_dp_rank} is outside the peer's {} DP ranks",
                peer.dp_size
            )));
        }
        // Under attention DP with pp = cp = 1, instance rank = TP rank = DP rank.
        Ok(PeerTargets {
            ranks: vec![peer_dp_rank].into(),
            uniform: true,
        })
    }

    fn pair(
        &self,
        _me: &RankInfo,
        _peer: &RankInfo,
        my_rows: &[LayerGroupRows],
        peer_rows: &[LayerGroupRows],
        request: &PairRequest,
    ) -> Result<TransferPlan, PlanError> {
        let plan = self.latent_rows(my_rows, peer_rows, request)?;
        plan.expand(my_rows, peer_rows)
            .map_err(|e| PlanError::invalid(format!("expanding the compressed plan: {e}")))
    }

    fn pair_compressed(
        &self,
        _me: &RankInfo,
        _peer: &RankInfo,
        my_rows: &[LayerGroupRows],
        peer_rows: &[LayerGroupRows],
        request: &PairRequest,
    ) -> Result<Option<CompressedPlan>, PlanError> {
        self.latent_rows(my_rows, peer_rows, request).map(Some)
    }
}

impl DeepseekMlaLatent {
    /// One pattern, the whole latent row, over the ordinals both sides hold in the piece.
    /// Rows whose slots are byte-adjacent on both sides become one write when the host
    /// merges the expanded fragments.
    fn latent_rows(
        &self,
        my_rows: &[LayerGroupRows],
        peer_rows: &[LayerGroupRows],
        request: &PairRequest,
    ) -> Result<CompressedPlan, PlanError> {
        let mut plan = CompressedPlan::new();
        // An excluded view on either side describes no rows: nothing to move.
        let (src, dst) = match (my_rows, peer_rows) {
            ([], _) | (_, []) => return Ok(plan),
            ([src], [dst]) => (src, dst),
            _ => {
                return Err(PlanError::invalid(format!(
                    "expected one row set per side (the latent view), got {} and {}",
                    my_rows.len(),
                    peer_rows.len()
                )));
            }
        };
        if src.row_bytes != dst.row_bytes {
            return Err(PlanError::invalid(format!(
                "row sizes differ: {} here, {} on the peer",
                src.row_bytes, dst.row_bytes
            )));
        }
        if u32::try_from(src.len().max(dst.len())).is_err() {
            return Err(PlanError::invalid(format!(
                "{} rows: a plan indexes at most 2^32",
                src.len().max(dst.len())
            )));
        }
        let tpb = u64::from(self.tokens_per_block);
        let range = request.token_range;
        let mut lo = range.start / tpb;
        if let Some(start) = request.dst_start_token.into_option() {
            lo = lo.max(start / tpb);
        }
        let hi = range.end.div_ceil(tpb);
        let mut pattern = PlanPattern::new(0, 0);
        if src.row_bytes > 0 {
            pattern.push_fragment(0, 0, src.row_bytes);
        }
        let (mut i, mut j) = (0, 0);
        while i < src.ordinals.len() && j < dst.ordinals.len() {
            let (so, d_o) = (src.ordinals[i], dst.ordinals[j]);
            if so < d_o {
                i += 1;
                continue;
            }
            if d_o < so {
                j += 1;
                continue;
            }
            if so >= hi {
                break;
            }
            if so >= lo {
                pattern.push_rows(i as u32, j as u32);
            }
            i += 1;
            j += 1;
        }
        plan.patterns.push(pattern);
        Ok(plan)
    }
}

impl PlannerPlugin for DeepseekMlaLatent {
    const PLANNER_ID: &'static str = "kvferry.deepseek_mla_latent";

    /// One architecture under restricted mappings (attention DP, pp = cp = 1).
    const SPECIFICITY: Specificity = Specificity::DEPLOYMENT;

    fn supports_deployment(deployment: &Deployment) -> Result<(), DeploymentRefusal> {
        let m = &deployment.mapping;
        if deployment.architecture.as_str() != ARCHITECTURE {
            return Err(DeploymentRefusal::new(
                "architecture",
                &deployment.architecture,
                ARCHITECTURE,
                "the MLA latent layout is DeepSeek-V3's",
            ));
        }
        if !m.attention_dp {
            return Err(DeploymentRefusal::new(
                "mapping.attention_dp",
                false,
                "true (depN)",
                "each rank must hold whole requests: every rank's latent cache is complete",
            ));
        }
        if m.pp != 1 {
            return Err(DeploymentRefusal::new(
                "mapping.pp",
                m.pp,
                1,
                "layers split over pipeline stages need the default planner's PP overlap",
            ));
        }
        if m.cp != 1 {
            return Err(DeploymentRefusal::new(
                "mapping.cp",
                m.cp,
                1,
                "tokens split over context-parallel ranks need the default planner's helix CP",
            ));
        }
        Ok(())
    }

    fn new(me: &RankInfo) -> Result<Self, PlanError> {
        let latent = Latent::of(&me.page_table)?;
        // A readable summary of what check_peer compares, for logs on the peer side.
        let description = format!(
            "{} tpb={} dtype={} slot_bytes={} layers={}",
            Self::PLANNER_ID,
            latent.tokens_per_block,
            latent.dtype,
            latent.slot_bytes,
            latent.layers.len()
        )
        .into_bytes();
        Ok(Self {
            tokens_per_block: latent.tokens_per_block,
            description,
        })
    }
}

export_planner!(DeepseekMlaLatent);

#[cfg(test)]
mod tests;
