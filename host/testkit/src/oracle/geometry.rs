//! The geometry of a rank's views, read off its page table alone: how each view's layer
//! region splits into runs of one head of one token, one state head or one section shard.

use kvferry_planner_abi::{GroupKind, LayerRange, LayoutKind, RankInfo};

use super::report::Logical;
use super::tags::{NO_TOKEN, combine, fnv1a, stream};
use super::{OracleError, input_error};

/// How a view's layer region splits into runs.
#[derive(Clone, Debug)]
enum Shape {
    /// `buffers × [heads][tokens][row]` (HND, REPLICATED) or `buffers × [tokens][heads][row]`
    /// (NHD); STATE views have one "token".
    Heads {
        heads: u64,
        /// Bytes of one head of one token (PAGED) or of one head (STATE).
        row: u64,
        /// Global index of the rank's first head.
        head_base: u64,
        token_major: bool,
    },
    /// STATE sections, each the rank's shard of the model's section.
    Sections { bytes: Vec<u64>, shard: u64 },
}

/// One view of a rank, modelled.
#[derive(Clone, Debug)]
pub(super) struct ViewGeom {
    pub(super) group: usize,
    pub(super) view: usize,
    pub(super) kind: GroupKind,
    pub(super) pool: usize,
    roles: String,
    pub(super) roles_hash: u64,
    /// Hash of (salt, kind, roles).
    seed: u64,
    pub(super) tpb: u64,
    buffers: u64,
    buffer_bytes: u64,
    shape: Shape,
    pub(super) layers: Vec<LayerRange>,
}

impl ViewGeom {
    fn tokens(&self) -> u64 {
        if self.kind == GroupKind::PAGED {
            self.tpb
        } else {
            1
        }
    }

    /// Calls `run(offset, len, seed, start, t)` for every run of the region of `layer` whose
    /// first token is `token0`: bytes `offset .. offset + len` of the region are bytes
    /// `start ..` of the stream keyed by `seed`, and belong to token `t` of the block (0 for
    /// runs without a token).
    fn for_each_run(
        &self,
        layer: u32,
        token0: u64,
        mut run: impl FnMut(usize, usize, u64, u64, u64),
    ) {
        let layer_seed = combine(self.seed, u64::from(layer));
        match &self.shape {
            Shape::Heads {
                heads,
                row,
                head_base,
                token_major,
            } => {
                let tokens = self.tokens();
                let paged = self.kind == GroupKind::PAGED;
                for b in 0..self.buffers {
                    let buffer_seed = combine(layer_seed, b);
                    let buffer_off = b * self.buffer_bytes;
                    for h in 0..*heads {
                        let head_seed = combine(buffer_seed, head_base + h);
                        for t in 0..tokens {
                            let token = if paged { token0 + t } else { NO_TOKEN };
                            let off = if *token_major {
                                buffer_off + (t * heads + h) * row
                            } else {
                                buffer_off + (h * tokens + t) * row
                            };
                            run(off as usize, *row as usize, combine(head_seed, token), 0, t);
                        }
                    }
                }
            }
            Shape::Sections { bytes, shard } => {
                let mut off = 0;
                for (k, &len) in bytes.iter().enumerate() {
                    let seed = combine(combine(layer_seed, k as u64), u64::MAX - 1);
                    run(off as usize, len as usize, seed, shard * len, 0);
                    off += len;
                }
            }
        }
    }

    pub(super) fn render(&self, layer: u32, token0: u64, out: &mut [u8]) {
        self.for_each_run(layer, token0, |off, len, seed, start, _| {
            stream(seed, start, &mut out[off..off + len]);
        });
    }

    /// [`render`](Self::render) for the runs of the tokens `keep` accepts (token in block)
    /// only; the other bytes of `out` are left as they are.
    pub(super) fn render_tokens(
        &self,
        layer: u32,
        token0: u64,
        keep: impl Fn(u64) -> bool,
        out: &mut [u8],
    ) {
        self.for_each_run(layer, token0, |off, len, seed, start, t| {
            if keep(t) {
                stream(seed, start, &mut out[off..off + len]);
            }
        });
    }

    /// The logical identity of byte `off` of the region of `layer` starting at `token0`.
    pub(super) fn describe(&self, layer: u32, token0: u64, off: u64) -> Logical {
        let roles = self.roles.clone();
        match &self.shape {
            Shape::Heads {
                heads,
                row,
                head_base,
                token_major,
            } => {
                let tokens = self.tokens();
                let buffer = off / self.buffer_bytes;
                let r = off % self.buffer_bytes;
                let (h, t) = if *token_major {
                    (r / row % heads, r / row / heads)
                } else {
                    (r / row / tokens, r / row % tokens)
                };
                let byte = r % row;
                if self.kind == GroupKind::PAGED {
                    Logical::Token {
                        layer,
                        roles,
                        buffer: buffer as u32,
                        head: head_base + h,
                        token: token0 + t,
                        byte,
                    }
                } else {
                    Logical::State {
                        layer,
                        roles,
                        buffer: buffer as u32,
                        head: head_base + h,
                        byte,
                    }
                }
            }
            Shape::Sections { bytes, shard } => {
                let mut start = 0;
                for (k, &len) in bytes.iter().enumerate() {
                    if off < start + len {
                        return Logical::Section {
                            layer,
                            roles,
                            section: k as u32,
                            byte: shard * len + off - start,
                        };
                    }
                    start += len;
                }
                Logical::Section {
                    layer,
                    roles,
                    section: bytes.len() as u32,
                    byte: off - start,
                }
            }
        }
    }
}

/// Models every view of `info`'s page table.
pub(super) fn model_views(salt: u64, info: &RankInfo) -> Result<Vec<ViewGeom>, OracleError> {
    let pt = &info.page_table;
    let tpb = u64::from(pt.tokens_per_block);
    let mut out = Vec::new();
    for (g, group) in pt.groups.iter().enumerate() {
        for (v, view) in group.views.iter().enumerate() {
            let at = |m: String| input_error(info, format!("group {g} view {v}: {m}"));
            let layers = view
                .layer_ranges(group)
                .map_err(|source| OracleError::ViewLayers {
                    instance: info.instance_name.to_string(),
                    rank: info.instance_rank,
                    group: g,
                    view: v,
                    source,
                })?;
            let Some(first) = layers.first() else {
                continue;
            };
            let pool = pt
                .pools
                .get(view.pool as usize)
                .ok_or_else(|| at(format!("pool {} does not exist", view.pool)))?;
            if let Some(bad) = view
                .entries
                .iter()
                .find(|e| e.offset + e.size > pool.slot_bytes)
            {
                return Err(at(format!(
                    "entry at offset {} runs past the slot's {} bytes",
                    bad.offset, pool.slot_bytes
                )));
            }
            let buffers = u64::from(first.buffers);
            if first.size % buffers != 0
                || view.entries.iter().any(|e| e.size * buffers != first.size)
            {
                return Err(at("buffers of a layer differ in size".to_string()));
            }
            let buffer_bytes = first.size / buffers;
            let l = &view.layout;
            let paged = group.kind == GroupKind::PAGED;
            let tokens = if paged { tpb } else { 1 };
            let unsupported =
                |what: &str| at(format!("{} {what} views are not modelled", group.kind));
            let shape = match l.kind {
                LayoutKind::HND | LayoutKind::REPLICATED | LayoutKind::NHD => {
                    let replicated = l.kind == LayoutKind::REPLICATED;
                    let token_major = l.kind == LayoutKind::NHD;
                    if token_major && !paged {
                        return Err(unsupported("nhd"));
                    }
                    // Bytes of one head of one token.
                    let unit = if replicated || l.shard_unit_bytes == 0 {
                        buffer_bytes
                    } else {
                        l.shard_unit_bytes
                    };
                    let (heads, row) = if token_major {
                        let per_token = buffer_bytes / tokens;
                        let unit = if l.shard_unit_bytes == 0 {
                            per_token
                        } else {
                            l.shard_unit_bytes
                        };
                        if per_token * tokens != buffer_bytes || per_token % unit != 0 {
                            return Err(at(format!(
                                "a {buffer_bytes}-byte buffer is not {tokens} tokens of \
                                 {unit}-byte heads"
                            )));
                        }
                        (per_token / unit, unit)
                    } else {
                        if buffer_bytes % unit != 0 || unit % tokens != 0 {
                            return Err(at(format!(
                                "a {buffer_bytes}-byte buffer is not made of {unit}-byte heads \
                                 of {tokens} tokens"
                            )));
                        }
                        (buffer_bytes / unit, unit / tokens)
                    };
                    let head_base = if replicated {
                        0
                    } else {
                        u64::from(l.shard_index) * heads
                    };
                    Shape::Heads {
                        heads,
                        row,
                        head_base,
                        token_major,
                    }
                }
                LayoutKind::SECTIONED if !paged => Shape::Sections {
                    bytes: l.section_bytes.to_vec(),
                    shard: u64::from(l.shard_index),
                },
                LayoutKind::SECTIONED => return Err(unsupported("sectioned")),
                other => return Err(unsupported(&other.to_string())),
            };
            let roles = view
                .roles
                .iter()
                .map(|r| r.as_str())
                .collect::<Vec<_>>()
                .join(",");
            let roles_hash = fnv1a(roles.as_bytes());
            let kind_code = u64::from(group.kind.0);
            out.push(ViewGeom {
                group: g,
                view: v,
                kind: group.kind,
                pool: view.pool as usize,
                seed: combine(combine(salt, kind_code), roles_hash),
                roles,
                roles_hash,
                tpb,
                buffers,
                buffer_bytes,
                shape,
                layers,
            });
        }
    }
    Ok(out)
}
