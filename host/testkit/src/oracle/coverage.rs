//! Coverage: which receiver bytes a delivery must have written, from what the prefill side
//! holds and the pieces sent (see the module docs of [`super`]).

use std::collections::HashMap;

use kvferry_plan::RequestSide;
use kvferry_planner_abi::{GroupKind, PairRequest, SlotTable};

use super::image::{PoolImage, RankModel, add_masked_segment, add_segment};
use super::tags::Background;
use super::{Oracle, OracleError, input_error};

/// What the prefill side holds, by (group kind, roles, global layer).
pub(super) struct PrefillHoldings {
    pub(super) tokens_per_block: Option<u64>,
    by_layer: HashMap<(u8, u64, u32), Holding>,
}

#[derive(Default)]
pub(super) struct Holding {
    /// Held global ordinals (PAGED).
    pub(super) ordinals: Vec<bool>,
    /// Whether a state slot is held (STATE).
    pub(super) state: bool,
}

impl PrefillHoldings {
    pub(super) fn new(salt: u64, context: &[RequestSide<'_>]) -> Result<Self, OracleError> {
        let mut out = Self {
            tokens_per_block: None,
            by_layer: HashMap::new(),
        };
        for side in context {
            let model = RankModel::new(salt, side.info)?;
            model.check_tables(side.slot_tables)?;
            let tpb = u64::from(side.info.page_table.tokens_per_block);
            match out.tokens_per_block {
                Some(t) if t != tpb => {
                    return Err(input_error(
                        side.info,
                        format!("tokens_per_block {tpb} differs from other prefill ranks' {t}"),
                    ));
                }
                _ => out.tokens_per_block = Some(tpb),
            }
            for geom in &model.geoms {
                let id = (geom.group as u32, geom.view as u32);
                if side.excluded.iter().any(|e| (e.group, e.view) == id) {
                    continue;
                }
                let table = &side.slot_tables[geom.group];
                let held: Vec<u64> = table
                    .slots
                    .iter()
                    .enumerate()
                    .filter(|&(_, &s)| s != SlotTable::HOLE)
                    .map(|(j, _)| model.global_ordinal(j as u64))
                    .collect();
                for layer in &geom.layers {
                    let key = (geom.kind.0, geom.roles_hash, layer.global);
                    let h = out.by_layer.entry(key).or_default();
                    if geom.kind == GroupKind::STATE {
                        h.state |= !held.is_empty();
                        continue;
                    }
                    for &g in &held {
                        let g = g as usize;
                        if h.ordinals.len() <= g {
                            h.ordinals.resize(g + 1, false);
                        }
                        h.ordinals[g] = true;
                    }
                }
            }
        }
        Ok(out)
    }

    pub(super) fn get(&self, kind: GroupKind, roles_hash: u64, layer: u32) -> Option<&Holding> {
        self.by_layer.get(&(kind.0, roles_hash, layer))
    }
}

impl RankModel<'_> {
    /// Images of every pool of a receiver: tags where the delivery covers, canary elsewhere.
    pub(super) fn receiver_images(
        &self,
        oracle: &Oracle,
        side: RequestSide<'_>,
        held: &PrefillHoldings,
        pieces: &[PairRequest],
    ) -> Result<Vec<PoolImage>, OracleError> {
        self.check_tables(side.slot_tables)?;
        // Block sizes may differ (semantics §3.2 rule 4, one a multiple of the other):
        // coverage is decided per unit of the smaller block, `unit` tokens.
        let tpb = u64::from(self.page_table().tokens_per_block);
        let ctx_tpb = held.tokens_per_block.unwrap_or(tpb);
        let unit = tpb.min(ctx_tpb);
        if tpb.max(ctx_tpb) % unit != 0 || tpb / unit > 64 {
            return Err(input_error(
                self.info,
                format!(
                    "tokens_per_block {tpb} against the prefill side's {ctx_tpb}: one must be \
                     a multiple of the other (at most 64 times)"
                ),
            ));
        }
        let per_block = tpb / unit;
        // Requested units per piece, `[start / unit, ceil(end / unit))`, from the receiver
        // block holding `dst_start_token` on.
        let requested: Vec<(u64, u64)> = pieces
            .iter()
            .map(|p| {
                let mut lo = p.token_range.start / unit;
                if let Some(t) = p.dst_start_token.into_option() {
                    lo = lo.max(t / tpb * per_block);
                }
                (lo, p.token_range.end.div_ceil(unit))
            })
            .collect();
        let last_sent = pieces.iter().any(|p| p.is_last);
        let mut images = self.blank_images(oracle, Background::Canary);
        for (gi, geom) in self.geoms.iter().enumerate() {
            let id = (geom.group as u32, geom.view as u32);
            if side.excluded.iter().any(|e| (e.group, e.view) == id) {
                continue;
            }
            let table = &side.slot_tables[geom.group];
            for layer in &geom.layers {
                let Some(holding) = held.get(geom.kind, geom.roles_hash, layer.global) else {
                    continue;
                };
                if geom.kind == GroupKind::STATE {
                    if let (Some(&slot), true, true) =
                        (table.slots.first(), holding.state, last_sent)
                    {
                        if slot != SlotTable::HOLE {
                            add_segment(&mut images[geom.pool], slot as u64, gi, layer, 0);
                        }
                    }
                    continue;
                }
                for (j, &slot) in table.slots.iter().enumerate() {
                    if slot == SlotTable::HOLE {
                        continue;
                    }
                    let g = self.global_ordinal(j as u64);
                    let mut bits = 0u64;
                    for k in 0..per_block {
                        let u = g * per_block + k;
                        let wanted = requested.iter().any(|&(lo, hi)| (lo..hi).contains(&u));
                        let c = u * unit / ctx_tpb;
                        let has = holding.ordinals.get(c as usize).copied().unwrap_or(false);
                        if wanted && has {
                            bits |= 1 << k;
                        }
                    }
                    let all = if per_block == 64 {
                        u64::MAX
                    } else {
                        (1 << per_block) - 1
                    };
                    if bits == all {
                        add_segment(&mut images[geom.pool], slot as u64, gi, layer, g * tpb);
                    } else if bits != 0 {
                        let mask = Some((unit, bits));
                        add_masked_segment(
                            &mut images[geom.pool],
                            slot as u64,
                            gi,
                            layer,
                            g * tpb,
                            mask,
                        );
                    }
                }
            }
        }
        self.finish(images)
    }
}
