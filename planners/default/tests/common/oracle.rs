//! A byte-level mini-oracle: simulates every pool of both instances as bytes at their
//! synthetic addresses, fills the context side with tags that encode each byte's logical
//! position (layer, buffer, global head, global token, byte / section, global channel), runs
//! the protocol as the host does (receiver targets → sender check and pair per piece),
//! executes every fragment and checks every destination byte.

use std::collections::{BTreeMap, HashMap};

use kvferry_planner_abi::{
    GroupKind, LayerGroupRows, LayerRange, LayoutKind, PageTable, PlanError, PlannerPlugin,
    RankInfo, SlotTable, TransferPlanner, ViewId,
};
use kvferry_planner_default::DefaultPlanner;

use super::{Deploy, Model, piece, rows_excluding};

/// One request moved from a context instance to a generation instance.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub ctx_model: Model,
    pub gen_model: Model,
    pub ctx: Deploy,
    pub generation: Deploy,
    pub prompt: u64,
    /// The request's DP group on the context side.
    pub ctx_dp: u32,
    /// Token ranges the context sends, in order; the last one carries the state.
    pub pieces: Vec<(u64, u64)>,
    /// Global ordinals the context side does not hold.
    pub ctx_holes: Vec<u64>,
    /// Global ordinals the generation side masks (cached, out of window).
    pub gen_holes: Vec<u64>,
    /// Whether the generation side has a state slot for the request.
    pub gen_state: bool,
    /// Views the generation side excludes.
    pub excluded: Vec<ViewId>,
}

impl Scenario {
    /// The whole prompt in one piece, every block held on both sides.
    pub fn new(model: &Model, ctx: Deploy, generation: Deploy, prompt: u64) -> Self {
        Self {
            ctx_model: model.clone(),
            gen_model: model.clone(),
            ctx,
            generation,
            prompt,
            ctx_dp: 0,
            pieces: vec![(0, prompt)],
            ctx_holes: Vec::new(),
            gen_holes: Vec::new(),
            gen_state: true,
            excluded: Vec::new(),
        }
    }
}

/// What happened, per generation rank.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Writers the rank waited for (its targets).
    pub writers: BTreeMap<u32, usize>,
    /// Writers whose plans moved at least one byte.
    pub busy_writers: BTreeMap<u32, usize>,
    /// Bytes received.
    pub bytes: BTreeMap<u32, u64>,
}

/// Simulated memory: every pool of every rank, keyed by base address.
#[derive(Default)]
struct Memory {
    pools: BTreeMap<u64, Vec<u8>>,
    writes: BTreeMap<u64, Vec<u8>>,
}

impl Memory {
    fn add(&mut self, pt: &PageTable) {
        for p in pt.pools.iter() {
            let size = (p.num_slots * p.slot_stride) as usize;
            self.pools.insert(p.base, vec![0; size]);
            self.writes.insert(p.base, vec![0; size]);
        }
    }

    fn locate(&self, addr: u64, len: u64) -> (u64, usize) {
        let (&base, bytes) = self
            .pools
            .range(..=addr)
            .next_back()
            .unwrap_or_else(|| panic!("address {addr:#x} is in no pool"));
        let at = (addr - base) as usize;
        assert!(
            at + len as usize <= bytes.len(),
            "[{addr:#x}, +{len}) runs past its pool"
        );
        (base, at)
    }

    fn copy(&mut self, src: u64, dst: u64, len: u64) {
        let (sb, s) = self.locate(src, len);
        let (db, d) = self.locate(dst, len);
        let data = self.pools[&sb][s..s + len as usize].to_vec();
        self.pools.get_mut(&db).expect("pool")[d..d + len as usize].copy_from_slice(&data);
        for w in &mut self.writes.get_mut(&db).expect("pool")[d..d + len as usize] {
            *w += 1;
        }
    }
}

/// The tag of a logical position, never 0 (0 is "not written").
fn tag(key: [u64; 6]) -> u8 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for k in key {
        h ^= k;
        h = h.wrapping_mul(0x100_0000_01b3);
        h ^= h >> 29;
    }
    (h % 255 + 1) as u8
}

/// The logical position of byte `at` of a row holding global ordinal `ordinal`, or `None`
/// when no layer region of the view covers it.
fn logical(
    model: &Model,
    pt: &PageTable,
    (id, ranges): (ViewId, &[LayerRange]),
    ordinal: u64,
    at: u64,
) -> Option<[u64; 6]> {
    let group = &pt.groups[id.group as usize];
    let l = &group.views[id.view as usize].layout;
    let r = ranges
        .iter()
        .find(|r| r.offset <= at && at < r.offset + r.size)?;
    let x = at - r.offset;
    let layer = u64::from(r.global);
    let tpb = u64::from(pt.tokens_per_block);
    let htb = model.head_token_bytes();
    if group.kind == GroupKind::PAGED {
        let buf = r.size / u64::from(r.buffers);
        let (k, y) = (x / buf, x % buf);
        let (head_local, token, byte, heads) = if l.kind == LayoutKind::NHD {
            let tok = buf / tpb;
            let (token, z) = (y / tok, y % tok);
            (z / htb, token, z % htb, tok / htb)
        } else {
            let unit = tpb * htb;
            let (h, z) = (y / unit, y % unit);
            (h, z / htb, z % htb, buf / unit)
        };
        let head = u64::from(l.shard_index) * heads + head_local;
        return Some([1, layer, k, head, ordinal * tpb + token, byte]);
    }
    let shard = u64::from(l.shard_index);
    if l.kind == LayoutKind::SECTIONED {
        let mut start = 0;
        for (k, &sec) in l.section_bytes.iter().enumerate() {
            if x < start + sec {
                return Some([2, layer, k as u64, shard * sec + (x - start), 0, 0]);
            }
            start += sec;
        }
        unreachable!("sections cover the region");
    }
    if l.kind == LayoutKind::HND {
        return Some([3, layer, 0, shard * r.size + x, 0, 0]);
    }
    Some([4, layer, 0, x, 0, 0])
}

/// Global ordinal of a receiver row: helix ranks hold every `cp`-th block.
fn global_ordinal(ri: &RankInfo, local: u64) -> u64 {
    local * u64::from(ri.cp_size) + u64::from(ri.cp_rank)
}

/// Slot tables of one rank: PAGED tables positional over its (local) ordinals.
fn slot_tables(
    ri: &RankInfo,
    model: &Model,
    prompt: u64,
    holes: &[u64],
    state: bool,
    shift: u64,
) -> Vec<SlotTable> {
    let blocks = prompt.div_ceil(u64::from(model.tpb));
    let (c, r) = (u64::from(ri.cp_size), u64::from(ri.cp_rank));
    let local = if blocks > r {
        (blocks - r).div_ceil(c)
    } else {
        0
    };
    ri.page_table
        .groups
        .iter()
        .map(|g| {
            if g.kind == GroupKind::STATE {
                let slot = ((shift + 2) % model.slots) as i64;
                SlotTable::new(if state { vec![slot] } else { vec![] })
            } else {
                SlotTable::new((0..local).map(|j| {
                    let o = global_ordinal(ri, j);
                    if holes.contains(&o) {
                        SlotTable::HOLE
                    } else {
                        ((j * 3 + shift) % model.slots) as i64
                    }
                }))
            }
        })
        .collect()
}

/// Runs the scenario; panics on any wrong, missing, stray or doubly written byte.
pub fn run(s: &Scenario) -> Result<Outcome, PlanError> {
    let ctx: Vec<RankInfo> = (0..s.ctx.world())
        .map(|r| s.ctx.rank(&s.ctx_model, r))
        .collect();
    let generation: Vec<RankInfo> = (0..s.generation.world())
        .map(|r| s.generation.rank(&s.gen_model, r))
        .collect();
    let mut mem = Memory::default();
    let mut ctx_rows: Vec<Vec<LayerGroupRows>> = Vec::new();
    for ri in &ctx {
        mem.add(&ri.page_table);
        let t = slot_tables(ri, &s.ctx_model, s.prompt, &s.ctx_holes, true, 1);
        let rows = rows_excluding(ri, &t, &[]);
        for r in &rows {
            let ranges = ranges_of(&ri.page_table, r.view);
            for (&o, &addr) in r.ordinals.iter().zip(r.addresses.iter()) {
                for at in 0..r.row_bytes {
                    let view = (r.view, ranges.as_slice());
                    if let Some(key) = logical(&s.ctx_model, &ri.page_table, view, o, at) {
                        let (base, i) = mem.locate(addr + at, 1);
                        mem.pools.get_mut(&base).expect("pool")[i] = tag(key);
                    }
                }
            }
        }
        ctx_rows.push(rows);
    }
    let gen_rows: Vec<Vec<LayerGroupRows>> = generation
        .iter()
        .map(|ri| {
            mem.add(&ri.page_table);
            let t = slot_tables(ri, &s.gen_model, s.prompt, &s.gen_holes, s.gen_state, 2);
            rows_excluding(ri, &t, &s.excluded)
        })
        .collect();

    let planner = |ri: &RankInfo| DefaultPlanner::new(ri).expect("planner");
    let ctx_planners: Vec<DefaultPlanner> = ctx.iter().map(planner).collect();
    let mut out = Outcome::default();
    for (g, gri) in generation.iter().enumerate() {
        let g = g as u32;
        let gp = planner(gri);
        gp.check_peer(gri, &ctx[0])?;
        let targets = gp.targets(gri, &ctx[0], s.ctx_dp)?;
        out.writers.insert(g, targets.ranks.len());
        let mut busy = 0;
        let mut bytes = 0;
        for &c in targets.ranks.iter() {
            let (cri, cp) = (&ctx[c as usize], &ctx_planners[c as usize]);
            cp.check_peer(cri, gri)?;
            let back = cp.targets(cri, gri, gri.dp_rank)?;
            assert!(
                back.ranks.contains(&g),
                "context rank {c} does not list generation rank {g} among its targets {:?}",
                back.ranks
            );
            let mut moved = 0;
            for (k, &(start, end)) in s.pieces.iter().enumerate() {
                let req = piece(start, end, s.prompt, k + 1 == s.pieces.len());
                let plan = cp.pair(cri, gri, &ctx_rows[c as usize], &gen_rows[g as usize], &req)?;
                for (src, dst, len) in plan.iter() {
                    assert!(
                        inside(&ctx_rows[c as usize], src, len),
                        "source {src:#x}+{len}"
                    );
                    assert!(
                        inside(&gen_rows[g as usize], dst, len),
                        "dest {dst:#x}+{len}"
                    );
                    mem.copy(src, dst, len);
                    moved += len;
                }
            }
            busy += usize::from(moved > 0);
            bytes += moved;
        }
        out.busy_writers.insert(g, busy);
        out.bytes.insert(g, bytes);
    }

    // Every generation byte: written once with the right tag where expected, else untouched.
    let blocks = s.prompt.div_ceil(u64::from(s.ctx_model.tpb));
    let tpb = u64::from(s.ctx_model.tpb);
    let sent = |o: u64| {
        o < blocks
            && !s.ctx_holes.contains(&o)
            && s.pieces
                .iter()
                .any(|&(a, b)| a / tpb <= o && o < b.div_ceil(tpb))
    };
    let ctx_layers = |kind: GroupKind, layer: u32| match kind {
        GroupKind::STATE => s
            .ctx_model
            .state
            .as_ref()
            .is_some_and(|st| st.layers.contains(&layer)),
        _ => s.ctx_model.attn.contains(&layer),
    };
    let mut expected: HashMap<u64, Vec<u8>> = HashMap::new();
    for (ri, rows) in generation.iter().zip(&gen_rows) {
        for p in ri.page_table.pools.iter() {
            expected.insert(p.base, vec![0; (p.num_slots * p.slot_stride) as usize]);
        }
        for r in rows {
            let group = &ri.page_table.groups[r.view.group as usize];
            let ranges = ranges_of(&ri.page_table, r.view);
            for (&local, &addr) in r.ordinals.iter().zip(r.addresses.iter()) {
                let o = global_ordinal(ri, local);
                let wanted = match group.kind {
                    GroupKind::STATE => true,
                    _ => sent(o),
                };
                for at in 0..r.row_bytes {
                    let view = (r.view, ranges.as_slice());
                    let Some(key) = logical(&s.gen_model, &ri.page_table, view, o, at) else {
                        continue;
                    };
                    if wanted && ctx_layers(group.kind, key[1] as u32) {
                        let (base, i) = mem.locate(addr + at, 1);
                        expected.get_mut(&base).expect("pool")[i] = tag(key);
                    }
                }
            }
        }
    }
    for (base, want) in &expected {
        let got = &mem.pools[base];
        let writes = &mem.writes[base];
        for i in 0..want.len() {
            assert!(
                writes[i] <= 1,
                "byte {:#x} written {} times",
                base + i as u64,
                writes[i]
            );
            assert_eq!(
                got[i],
                want[i],
                "byte {:#x} (pool {base:#x} + {i}): got {}, want {}",
                base + i as u64,
                got[i],
                want[i]
            );
        }
    }
    Ok(out)
}

/// Whether `[addr, addr + len)` lies inside one row of `rows`.
fn inside(rows: &[LayerGroupRows], addr: u64, len: u64) -> bool {
    rows.iter().any(|r| {
        r.addresses
            .iter()
            .any(|&a| a <= addr && addr + len <= a + r.row_bytes)
    })
}

/// The layer regions of a view.
fn ranges_of(pt: &PageTable, id: ViewId) -> Vec<LayerRange> {
    let group = &pt.groups[id.group as usize];
    group.views[id.view as usize]
        .layer_ranges(group)
        .expect("layer ranges")
}
