//! Pool matching (semantics §4): which peer views each local view exchanges bytes with.

use std::collections::{BTreeSet, HashMap};

use kvferry_planner_abi::{GroupKind, PageTable, PlanError};

use crate::side::Side;
use crate::view::{Layers, Roles, View};

/// Matches every view of `mine` to the views of `theirs` (the views of `their_table`) it
/// exchanges bytes with, as `(index into mine, index into theirs)` in `mine`'s page-table
/// order, then the peer's view order.
///
/// For a local view with layers:
/// 1. the peer layer groups of the same class (PAGED or STATE) that list any of its global
///    layers are collected; none → the view is skipped (the peer holds none of its layers),
///    more than one → refused (mismatched layer grouping);
/// 2. inside that group, every peer view with the same role set and at least one common
///    global layer is a match; one with a different layout kind is refused.
///
/// TensorRT-LLM stops at the first such peer view, relying on at most one existing. Keeping
/// every match is the same when that holds, and when it does not (one side split a role's
/// layers over several views, the other did not) it still moves every common layer instead
/// of silently dropping those of the later views: each pair's mapper copies only the layers
/// both views hold, so the pairs never write the same bytes.
pub(crate) fn match_views(
    mine: &[View<'_>],
    their_table: &PageTable,
    theirs: &[View<'_>],
    side: Side,
) -> Result<Vec<(usize, usize)>, PlanError> {
    let mut layer_groups: HashMap<(GroupKind, u32), BTreeSet<u32>> = HashMap::new();
    for (g, group) in their_table.groups.iter().enumerate() {
        for layer in group.layers.iter() {
            layer_groups
                .entry((group.kind, layer.global))
                .or_default()
                .insert(g as u32);
        }
    }

    let mut out = Vec::new();
    for (i, v) in mine.iter().enumerate() {
        if v.ranges.is_empty() {
            continue;
        }
        let groups: BTreeSet<u32> = v
            .globals()
            .filter_map(|l| layer_groups.get(&(v.class, l)))
            .flatten()
            .copied()
            .collect();
        let Some(&peer_group) = groups.first() else {
            continue;
        };
        if groups.len() > 1 {
            let globals: Vec<u32> = v.globals().collect();
            return Err(side.refuse(
                "layer_group",
                format!("{} over global layers {}", v.name(), Layers(&globals)),
                format!("{} layer groups {groups:?}", v.class),
                "the view's layers span several peer layer groups; mismatched layer grouping \
                 between peers is not supported",
            ));
        }
        let roles = v.roles();
        for (j, w) in theirs.iter().enumerate() {
            if w.id.group != peer_group || w.roles() != roles {
                continue;
            }
            if !w.globals().any(|l| v.layer(l).is_some()) {
                continue;
            }
            if w.layout().kind != v.layout().kind {
                return Err(side.refuse(
                    "layout.kind",
                    v.layout().kind,
                    w.layout().kind,
                    format!(
                        "incompatible mapper kinds for roles {} ({})",
                        Roles(&roles),
                        side.between(&v.name(), &w.name())
                    ),
                ));
            }
            out.push((i, j));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use kvferry_planner_abi::{GroupKind, LayoutKind, PageTable, PlanError, ViewId};

    use super::match_views;
    use crate::side::Side;
    use crate::testkit::{V, table};
    use crate::view::views;

    const HND: LayoutKind = LayoutKind::HND;
    const KV: &[&str] = &["key", "value"];
    const PAGED: GroupKind = GroupKind::PAGED;
    const STATE: GroupKind = GroupKind::STATE;

    /// `(group, view)` of a local and a peer view.
    type Matched = ((u32, u32), (u32, u32));

    /// The matching as `((group, view), (group, view))` pairs.
    fn matched(mine: &PageTable, theirs: &PageTable) -> Result<Vec<Matched>, PlanError> {
        let (a, b) = (views(mine)?, views(theirs)?);
        let id = |v: ViewId| (v.group, v.view);
        Ok(match_views(&a, theirs, &b, Side::Local)?
            .into_iter()
            .map(|(i, j)| (id(a[i].id), id(b[j].id)))
            .collect())
    }

    #[test]
    fn one_kv_view_per_side() {
        // §13.1
        let t = table(&[(PAGED, &[0, 1], &[V(KV, HND, &[0, 1], 64)])]);
        assert_eq!(matched(&t, &t).unwrap(), vec![((0, 0), (0, 0))]);
    }

    #[test]
    fn mla_key_only_view() {
        // §13.2
        let t = table(&[(PAGED, &[0, 1, 2], &[V(&["key"], HND, &[0, 1, 2], 576)])]);
        assert_eq!(matched(&t, &t).unwrap(), vec![((0, 0), (0, 0))]);
    }

    #[test]
    fn kv_and_block_scale_views_match_by_role() {
        // §13.3
        let t = table(&[(
            PAGED,
            &[0, 1],
            &[
                V(KV, HND, &[0, 1], 64),
                V(&["key_block_scale", "value_block_scale"], HND, &[0, 1], 8),
            ],
        )]);
        assert_eq!(
            matched(&t, &t).unwrap(),
            vec![((0, 0), (0, 0)), ((0, 1), (0, 1))]
        );
    }

    #[test]
    fn an_empty_view_is_skipped_and_kv_still_matches_by_role() {
        // §13.4: a view without entries holds no layer, so it has nothing to match.
        let t = table(&[(
            PAGED,
            &[0, 1],
            &[V(&["indexer_k"], HND, &[], 0), V(KV, HND, &[0, 1], 64)],
        )]);
        assert_eq!(matched(&t, &t).unwrap(), vec![((0, 1), (0, 1))]);
    }

    #[test]
    fn partial_pp_overlap_still_matches() {
        // §13.5
        let mine = table(&[(PAGED, &[10, 11], &[V(KV, HND, &[10, 11], 64)])]);
        let theirs = table(&[(PAGED, &[11, 12], &[V(KV, HND, &[11, 12], 64)])]);
        assert_eq!(matched(&mine, &theirs).unwrap(), vec![((0, 0), (0, 0))]);
        // No common layer: nothing to match, no error.
        let far = table(&[(PAGED, &[20, 21], &[V(KV, HND, &[20, 21], 64)])]);
        assert_eq!(matched(&mine, &far).unwrap(), vec![]);
    }

    #[test]
    fn distinct_roles_match_regardless_of_layer_set_sizes() {
        // §13.6
        let mine = table(&[(
            PAGED,
            &[0, 1, 2, 3],
            &[
                V(KV, HND, &[0, 1, 2, 3], 64),
                V(&["indexer_k"], LayoutKind::REPLICATED, &[1, 3], 16),
            ],
        )]);
        let theirs = table(&[(
            PAGED,
            &[0, 1, 2, 3],
            &[
                V(&["indexer_k"], LayoutKind::REPLICATED, &[1, 3], 16),
                V(KV, HND, &[0, 1, 2, 3], 64),
            ],
        )]);
        assert_eq!(
            matched(&mine, &theirs).unwrap(),
            vec![((0, 0), (0, 1)), ((0, 1), (0, 0))]
        );
    }

    #[test]
    fn a_same_role_view_without_common_layers_is_passed_over() {
        // §13.7
        let mine = table(&[(PAGED, &[0, 1, 2, 3], &[V(KV, HND, &[0, 1], 64)])]);
        let theirs = table(&[(
            PAGED,
            &[0, 1, 2, 3],
            &[V(KV, HND, &[2, 3], 64), V(KV, HND, &[0, 1], 64)],
        )]);
        assert_eq!(matched(&mine, &theirs).unwrap(), vec![((0, 0), (0, 1))]);
    }

    #[test]
    fn every_overlapping_same_role_view_is_kept() {
        // One side keeps a role's layers in one view, the other in two.
        let mine = table(&[(PAGED, &[0, 1, 2, 3], &[V(KV, HND, &[0, 1, 2, 3], 64)])]);
        let theirs = table(&[(
            PAGED,
            &[0, 1, 2, 3],
            &[V(KV, HND, &[0, 1], 64), V(KV, HND, &[2, 3], 64)],
        )]);
        assert_eq!(
            matched(&mine, &theirs).unwrap(),
            vec![((0, 0), (0, 0)), ((0, 0), (0, 1))]
        );
    }

    #[test]
    fn same_role_with_different_mapper_kinds_is_refused() {
        // §13.8
        let mine = table(&[(PAGED, &[0, 1], &[V(KV, HND, &[0, 1], 64)])]);
        let theirs = table(&[(PAGED, &[0, 1], &[V(KV, LayoutKind::NHD, &[0, 1], 64)])]);
        let err = matched(&mine, &theirs).unwrap_err();
        let refusal = err.refusal().expect("a refusal");
        assert_eq!(refusal.field.as_str(), "layout.kind");
        assert_eq!(
            (refusal.ours.as_str(), refusal.theirs.as_str()),
            ("hnd", "nhd")
        );
        assert!(err.message().contains("incompatible mapper kinds"), "{err}");
    }

    #[test]
    fn a_view_spanning_two_peer_groups_is_refused() {
        // §3.5
        let mine = table(&[(PAGED, &[0, 1], &[V(KV, HND, &[0, 1], 64)])]);
        let theirs = table(&[
            (PAGED, &[0], &[V(KV, HND, &[0], 64)]),
            (PAGED, &[1], &[V(KV, HND, &[1], 64)]),
        ]);
        let err = matched(&mine, &theirs).unwrap_err();
        assert_eq!(
            err.refusal().expect("refusal").field.as_str(),
            "layer_group"
        );
        assert!(err.message().contains("[0, 1]"), "{err}");
    }

    #[test]
    fn matching_is_scoped_to_the_group_class() {
        // A hybrid model may list one global layer in a PAGED and a STATE group.
        let t = table(&[
            (PAGED, &[0, 1], &[V(KV, HND, &[0, 1], 64)]),
            (STATE, &[0, 1], &[V(&["ssm"], HND, &[0, 1], 32)]),
        ]);
        assert_eq!(
            matched(&t, &t).unwrap(),
            vec![((0, 0), (0, 0)), ((1, 0), (1, 0))]
        );
    }
}
