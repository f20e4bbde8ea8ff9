//! One (layer group, view) of a page table, with its per-layer regions resolved once.

use std::collections::BTreeSet;
use std::fmt;

use kvferry_planner_abi::{
    GroupKind, LayerRange, LayoutKind, PageTable, PlanError, PoolView, RoleLayout, ViewId,
};

/// A view of a page table with everything the planner asks of it precomputed.
#[derive(Debug)]
pub(crate) struct View<'a> {
    /// Where the view sits in its page table.
    pub(crate) id: ViewId,
    /// The class of the view's layer group.
    pub(crate) class: GroupKind,
    /// The view itself.
    pub(crate) view: &'a PoolView,
    /// The view's layers in physical order (smallest offset first).
    pub(crate) ranges: Vec<LayerRange>,
}

impl<'a> View<'a> {
    /// The view's layout and shard declaration.
    pub(crate) fn layout(&self) -> &'a RoleLayout {
        &self.view.layout
    }

    /// Bytes of one layer's region (0 for a view without layers).
    pub(crate) fn region(&self) -> u64 {
        self.ranges.first().map_or(0, |r| r.size)
    }

    /// Buffers a layer's region is re-split by.
    ///
    /// A STATE HND view (SSM state) is `[head][...]` over the whole per-layer region, so it is
    /// re-split as one buffer whatever its entry count; any other view has one buffer per
    /// entry of a layer (K and V → 2).
    pub(crate) fn buffers(&self) -> u32 {
        if self.class == GroupKind::STATE && self.layout().kind == LayoutKind::HND {
            1
        } else {
            self.ranges.first().map_or(1, |r| r.buffers)
        }
    }

    /// The region of global layer `global`, if the view holds it.
    pub(crate) fn layer(&self, global: u32) -> Option<&LayerRange> {
        self.ranges.iter().find(|r| r.global == global)
    }

    /// The global layer ids of the view, in physical order.
    pub(crate) fn globals(&self) -> impl Iterator<Item = u32> + '_ {
        self.ranges.iter().map(|r| r.global)
    }

    /// The role set.
    pub(crate) fn roles(&self) -> BTreeSet<&'a str> {
        self.view.role_set()
    }

    /// `(num_shards, shard_index)`.
    pub(crate) fn shards(&self) -> (u32, u32) {
        (self.layout().num_shards, self.layout().shard_index)
    }

    /// A short human name: `group 0 view 1 {key,value} hnd`.
    pub(crate) fn name(&self) -> String {
        format!(
            "group {} view {} {} {}",
            self.id.group,
            self.id.view,
            Roles(&self.roles()),
            self.layout().kind
        )
    }
}

/// Every view of `pt`, in page-table order, after the page table's structural checks.
pub(crate) fn views(pt: &PageTable) -> Result<Vec<View<'_>>, PlanError> {
    pt.validate()?;
    let mut out = Vec::new();
    for (g, group) in pt.groups.iter().enumerate() {
        for (v, view) in group.views.iter().enumerate() {
            out.push(View {
                id: ViewId {
                    group: g as u32,
                    view: v as u32,
                },
                class: group.kind,
                view,
                ranges: view.layer_ranges(group)?,
            });
        }
    }
    Ok(out)
}

/// Displays a role set as `{key,value}`.
pub(crate) struct Roles<'r, 's>(pub(crate) &'r BTreeSet<&'s str>);

impl fmt::Display for Roles<'_, '_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("{")?;
        for (i, role) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            f.write_str(role)?;
        }
        f.write_str("}")
    }
}

/// Displays a layer list compactly: `[0, 1, 2]`, or `[0, 1, …, 79] (80 layers)` when long.
pub(crate) struct Layers<'l>(pub(crate) &'l [u32]);

impl fmt::Display for Layers<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            [] => f.write_str("[]"),
            [a, b, .., z] if self.0.len() > 4 => {
                write!(f, "[{a}, {b}, …, {z}] ({} layers)", self.0.len())
            }
            list => write!(f, "{list:?}"),
        }
    }
}
