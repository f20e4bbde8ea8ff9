//! Tiny page-table builders for the unit tests (the integration tests have realistic ones).

use kvferry_planner_abi::ffi::{ROption, RString, RVec};
use kvferry_planner_abi::{
    BufferEntry, GroupKind, LayerGroup, LayoutKind, LocalLayer, Mapping, MemoryType, PageTable,
    PhysicalPool, PoolView, RankInfo, RoleLayout,
};

/// One view: roles, layout kind, global layers (in slot order), bytes per layer.
pub(crate) struct V<'a>(
    pub(crate) &'a [&'a str],
    pub(crate) LayoutKind,
    pub(crate) &'a [u32],
    pub(crate) u64,
);

/// A page table from `(group kind, group layers, views)`; every view gets its own pool with
/// its layers back to back, one buffer per layer.
pub(crate) fn table(groups: &[(GroupKind, &[u32], &[V<'_>])]) -> PageTable {
    let mut pools = Vec::new();
    let mut out = Vec::new();
    for (kind, layers, views) in groups {
        let local = |g: u32| layers.iter().position(|&l| l == g).expect("layer") as u32;
        let mut vs = Vec::new();
        for V(roles, layout, held, bytes) in views.iter() {
            let pool = pools.len() as u32;
            pools.push(PhysicalPool {
                base: 0x1000_0000 * u64::from(pool + 1),
                slot_bytes: (held.len() as u64 * bytes).max(1),
                slot_stride: (held.len() as u64 * bytes).max(1),
                num_slots: 4,
                memory_type: MemoryType::VRAM,
            });
            vs.push(PoolView {
                pool,
                entries: held
                    .iter()
                    .enumerate()
                    .map(|(i, &g)| BufferEntry {
                        local_layer: local(g),
                        offset: i as u64 * bytes,
                        size: *bytes,
                    })
                    .collect(),
                roles: roles.iter().map(|r| RString::from(*r)).collect(),
                layout: RoleLayout::whole(*layout, "bf16", 16),
            });
        }
        out.push(LayerGroup {
            kind: *kind,
            window: ROption::RNone,
            layers: layers
                .iter()
                .enumerate()
                .map(|(i, &g)| LocalLayer {
                    local: i as u32,
                    global: g,
                })
                .collect(),
            views: RVec::from(vs),
        });
    }
    PageTable {
        tokens_per_block: 4,
        pools: RVec::from(pools),
        groups: RVec::from(out),
    }
}

/// A single-rank instance `name` holding `pt`.
pub(crate) fn rank(name: &str, pt: PageTable) -> RankInfo {
    RankInfo::new(name, &Mapping::SINGLE, 0, vec![4], pt).with_planner("kvferry.default")
}
