//! The expected content of a rank's pools: per slot, which view-layer regions carry tags, and
//! rendering, filling and checking slots against it.

use std::collections::BTreeMap;

use kvferry_plan::RequestSide;
use kvferry_planner_abi::{GroupKind, LayerRange, PageTable, PhysicalPool, RankInfo, SlotTable};

use super::geometry::{ViewGeom, model_views};
use super::memory::{PoolMemory, recycle, scratch};
use super::report::{Logical, Mismatch, Side, VerifyReport};
use super::tags::{Background, BackgroundSeed, stream};
use super::{Extent, Oracle, OracleError, input_error};

/// One covered view-layer region inside a slot.
#[derive(Clone, Copy, Debug)]
struct Segment {
    offset: u64,
    len: u64,
    geom: usize,
    layer: u32,
    token0: u64,
    /// Only some tokens of the block covered: `(tokens per unit, bit per unit)`; the other
    /// tokens keep the background (a receiver block larger than the sender's, partly held).
    mask: Option<(u64, u64)>,
}

impl Segment {
    fn keeps(&self, t: u64) -> bool {
        self.mask
            .is_none_or(|(unit, bits)| (bits >> (t / unit)) & 1 == 1)
    }
}

/// The expected content of one pool.
pub(super) struct PoolImage {
    index: usize,
    pub(super) pool: PhysicalPool,
    background: BackgroundSeed,
    /// Segments by slot, sorted by offset, non-overlapping.
    slots: BTreeMap<u64, Vec<Segment>>,
}

impl PoolImage {
    pub(super) fn blank(background: BackgroundSeed, pool: &PhysicalPool, index: usize) -> Self {
        Self {
            index,
            pool: pool.clone(),
            background,
            slots: BTreeMap::new(),
        }
    }

    pub(super) fn covered_bytes(&self) -> u64 {
        self.slots.values().flatten().map(|s| s.len).sum()
    }

    /// Offset and length of slot `s`'s span in the pool's footprint.
    fn span(&self, s: u64) -> (u64, u64) {
        let start = s * self.pool.slot_stride;
        let len = if s + 1 == self.pool.num_slots {
            self.pool.slot_bytes
        } else {
            self.pool.slot_stride
        };
        (start, len)
    }
}

/// A rank's views, modelled.
pub(super) struct RankModel<'a> {
    pub(super) info: &'a RankInfo,
    pub(super) geoms: Vec<ViewGeom>,
}

impl<'a> RankModel<'a> {
    pub(super) fn new(salt: u64, info: &'a RankInfo) -> Result<Self, OracleError> {
        Ok(Self {
            info,
            geoms: model_views(salt, info)?,
        })
    }

    pub(super) fn page_table(&self) -> &PageTable {
        &self.info.page_table
    }

    /// Global ordinal of local ordinal `j` (helix: `j × C + r`).
    pub(super) fn global_ordinal(&self, j: u64) -> u64 {
        let cp = u64::from(self.info.cp_size);
        if cp > 1 {
            j * cp + u64::from(self.info.cp_rank)
        } else {
            j
        }
    }

    pub(super) fn check_tables(&self, tables: &[SlotTable]) -> Result<(), OracleError> {
        let pt = self.page_table();
        if tables.len() != pt.groups.len() {
            return Err(input_error(
                self.info,
                format!(
                    "{} slot tables for {} layer groups",
                    tables.len(),
                    pt.groups.len()
                ),
            ));
        }
        for (g, (group, table)) in pt.groups.iter().zip(tables).enumerate() {
            if group.kind == GroupKind::STATE && table.slots.len() > 1 {
                return Err(input_error(
                    self.info,
                    format!(
                        "STATE group {g} has {} slots (at most 1)",
                        table.slots.len()
                    ),
                ));
            }
            for view in group.views.iter() {
                let pool = &pt.pools[view.pool as usize];
                if let Some(&bad) = table
                    .slots
                    .iter()
                    .find(|&&s| s != SlotTable::HOLE && (s < 0 || s as u64 >= pool.num_slots))
                {
                    return Err(input_error(
                        self.info,
                        format!(
                            "group {g} names slot {bad}, outside pool {} of {} slots",
                            view.pool, pool.num_slots
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Images of every pool of a sender: tags in every held slot of every view.
    pub(super) fn source_images(
        &self,
        oracle: &Oracle,
        side: RequestSide<'_>,
    ) -> Result<Vec<PoolImage>, OracleError> {
        self.check_tables(side.slot_tables)?;
        let mut images = self.blank_images(oracle, Background::Foreign);
        for (gi, geom) in self.geoms.iter().enumerate() {
            let table = &side.slot_tables[geom.group];
            for (j, &slot) in table.slots.iter().enumerate() {
                if slot == SlotTable::HOLE {
                    continue;
                }
                let token0 = self.global_ordinal(j as u64) * geom.tpb;
                for layer in &geom.layers {
                    add_segment(&mut images[geom.pool], slot as u64, gi, layer, token0);
                }
            }
        }
        self.finish(images)
    }
    pub(super) fn blank_images(&self, oracle: &Oracle, kind: Background) -> Vec<PoolImage> {
        self.page_table()
            .pools
            .iter()
            .enumerate()
            .map(|(p, pool)| PoolImage::blank(oracle.background(kind, self.info, p), pool, p))
            .collect()
    }

    /// Sorts every slot's segments and refuses overlaps (two ordinals in one slot, or views
    /// sharing bytes).
    pub(super) fn finish(&self, mut images: Vec<PoolImage>) -> Result<Vec<PoolImage>, OracleError> {
        for image in &mut images {
            for (slot, segments) in image.slots.iter_mut() {
                segments.sort_unstable_by_key(|s| s.offset);
                for w in segments.windows(2) {
                    if w[0].offset + w[0].len > w[1].offset {
                        return Err(input_error(
                            self.info,
                            format!(
                                "pool {} slot {slot} is claimed twice (two ordinals in one slot, \
                                 or overlapping views)",
                                image.index
                            ),
                        ));
                    }
                }
            }
        }
        Ok(images)
    }

    /// Renders bytes of slot `s` (its span) into `out`.
    fn render_slot(&self, image: &PoolImage, s: u64, out: &mut [u8]) {
        let (start, _) = image.span(s);
        let bg = image.background.seed;
        let mut cursor = 0usize;
        if let Some(segments) = image.slots.get(&s) {
            for seg in segments {
                let (a, b) = (seg.offset as usize, (seg.offset + seg.len) as usize);
                stream(bg, start + cursor as u64, &mut out[cursor..a]);
                let geom = &self.geoms[seg.geom];
                if seg.mask.is_some() {
                    stream(bg, start + a as u64, &mut out[a..b]);
                    geom.render_tokens(seg.layer, seg.token0, |t| seg.keeps(t), &mut out[a..b]);
                } else {
                    geom.render(seg.layer, seg.token0, &mut out[a..b]);
                }
                cursor = b;
            }
        }
        stream(bg, start + cursor as u64, &mut out[cursor..]);
    }

    /// The slots of each pool an oracle call over `extent` touches: `None` for every slot,
    /// else per pool the slots `tables` hold.
    pub(super) fn scope(&self, extent: Extent, tables: &[SlotTable]) -> Option<Vec<Vec<u64>>> {
        if extent == Extent::WholePools {
            return None;
        }
        let pt = self.page_table();
        let mut held = vec![Vec::new(); pt.pools.len()];
        for (group, table) in pt.groups.iter().zip(tables) {
            for view in group.views.iter() {
                let Some(slots) = held.get_mut(view.pool as usize) else {
                    continue;
                };
                slots.extend(table.slots.iter().filter(|&&s| s >= 0).map(|&s| s as u64));
            }
        }
        for slots in &mut held {
            slots.sort_unstable();
            slots.dedup();
        }
        Some(held)
    }

    /// The slots of `image`'s pool within `scope`.
    fn slots_in<'s>(
        image: &PoolImage,
        scope: Option<&'s [Vec<u64>]>,
    ) -> Box<dyn Iterator<Item = u64> + 's> {
        match scope {
            None => Box::new(0..image.pool.num_slots),
            Some(scope) => Box::new(
                scope
                    .get(image.index)
                    .map_or(&[][..], Vec::as_slice)
                    .iter()
                    .copied(),
            ),
        }
    }

    pub(super) fn fill(
        &self,
        memory: &mut dyn PoolMemory,
        image: &PoolImage,
        scope: Option<&[Vec<u64>]>,
    ) -> Result<u64, OracleError> {
        if image.pool.footprint() == 0 {
            return Ok(0);
        }
        // Reused across calls as the pools are: a fresh buffer of a slot's size is faulted in
        // page by page on every fill and check (a third of the oracle matrix's page faults).
        let mut scratch = scratch(image.pool.slot_stride as usize);
        let mut written = 0;
        for s in Self::slots_in(image, scope) {
            let (start, len) = image.span(s);
            let out = &mut scratch[..len as usize];
            self.render_slot(image, s, out);
            memory.write(image.pool.base + start, out)?;
            written += len;
        }
        recycle(std::iter::once(scratch));
        Ok(written)
    }

    pub(super) fn check(
        &self,
        memory: &dyn PoolMemory,
        image: &PoolImage,
        side: Side,
        oracle: &Oracle,
        report: &mut VerifyReport,
        scope: Option<&[Vec<u64>]>,
    ) -> Result<u64, OracleError> {
        if image.pool.footprint() == 0 {
            return Ok(0);
        }
        let stride = image.pool.slot_stride as usize;
        let mut scratch = scratch(2 * stride);
        let (expected_buf, found_buf) = scratch.split_at_mut(stride);
        let mut checked = 0;
        for s in Self::slots_in(image, scope) {
            let (start, len) = image.span(s);
            let expected = &mut expected_buf[..len as usize];
            let found = &mut found_buf[..len as usize];
            self.render_slot(image, s, expected);
            memory.read(image.pool.base + start, found)?;
            checked += len;
            if expected != found {
                for (i, (&e, &f)) in expected.iter().zip(found.iter()).enumerate() {
                    if e == f {
                        continue;
                    }
                    report.mismatched_bytes += 1;
                    if report.mismatches.len() < oracle.max_mismatches {
                        report.mismatches.push(Mismatch {
                            side,
                            instance: self.info.instance_name.to_string(),
                            rank: self.info.instance_rank,
                            pool: image.index as u32,
                            offset: start + i as u64,
                            logical: self.describe(image, s, i as u64),
                            expected: e,
                            found: f,
                        });
                    }
                }
            }
        }
        recycle(std::iter::once(scratch));
        Ok(checked)
    }

    fn describe(&self, image: &PoolImage, s: u64, off: u64) -> Logical {
        let padding = off >= image.pool.slot_bytes;
        if let Some(seg) = image.slots.get(&s).and_then(|segs| {
            segs.iter()
                .find(|g| (g.offset..g.offset + g.len).contains(&off))
        }) {
            let logical = self.geoms[seg.geom].describe(seg.layer, seg.token0, off - seg.offset);
            let masked =
                matches!(&logical, Logical::Token { token, .. } if !seg.keeps(token - seg.token0));
            if !masked {
                return logical;
            }
        }
        match image.background.kind {
            Background::Canary => Logical::Uncovered { slot: s, padding },
            Background::Foreign => Logical::Foreign { slot: s, padding },
        }
    }
}

pub(super) fn add_segment(
    image: &mut PoolImage,
    slot: u64,
    geom: usize,
    layer: &LayerRange,
    token0: u64,
) {
    add_masked_segment(image, slot, geom, layer, token0, None);
}

/// [`add_segment`] for some tokens of a block only: `mask = (tokens per unit, bit per unit)`.
pub(super) fn add_masked_segment(
    image: &mut PoolImage,
    slot: u64,
    geom: usize,
    layer: &LayerRange,
    token0: u64,
    mask: Option<(u64, u64)>,
) {
    image.slots.entry(slot).or_default().push(Segment {
        offset: layer.offset,
        len: layer.size,
        geom,
        layer: layer.global,
        token0,
        mask,
    });
}
