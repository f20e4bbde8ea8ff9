"""Simulated serving engines for the real-model end-to-end check (test_real_models.py).

An *engine* here is what a serving stack keeps per rank, and nothing more: paged KV pools it
allocates itself (numpy float32 host buffers), a block allocator shared by the ranks of an
instance, the page table that describes those pools to kvferry, and one ``kvferry.Agent``
per rank. It does not shard the model's compute: the prefill runs the real, unsharded
Hugging Face model, and each rank stores exactly the part of every layer's cache it would
hold under its parallel mapping — a TP rank's KV heads ``[r × h, (r + 1) × h)`` of the layers
of its PP stage, its channels of each Gated DeltaNet conv section and its value heads of the
recurrent state. The decode side reads each rank's pools back (nothing else crosses from
prefill to decode but kvferry's writes) and assembles the model's cache from them.

Per rank and PP stage, a page table has one PAGED group per attention kind present on the
stage (full attention, sliding window) and one STATE group for linear-attention layers:

* PAGED group: one pool, one view ``{key, value}``; a slot (block) holds, for each local
  layer of the group, its K buffer then its V buffer, each ``[head][token][dim]`` (HND) or
  ``[token][head][dim]`` (NHD) over the rank's heads and ``tokens_per_block`` tokens.
* STATE group (one slot per request): a ``conv`` pool, SECTIONED ``[Q | K | V]``, each
  section channel-major ``[channel][kernel]`` exactly as transformers keeps the conv state
  (``conv_kernel`` columns: the model's cache is moved as it is), and an ``ssm`` pool, HND
  ``[value head][key dim][value dim]`` in float32.

Every byte of every pool starts as NaN, so a byte the transfer should have written and did not
poisons the decode's logits instead of passing unnoticed.
"""

from __future__ import annotations

import json
import math
import select
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import kvferry

ELEM = 4  # float32 bytes
SECRET = "kvferry real-model e2e secret"


# ---------------------------------------------------------------------------------------------
# The model's cache geometry, read from its transformers config.


@dataclass(frozen=True)
class LinearGeometry:
    """A Gated DeltaNet layer's state: conv over ``[Q | K | V]`` channels, recurrent state
    ``[value head][key dim][value dim]``."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    def sections(self) -> tuple[int, int, int]:
        """Channels of Q, K and V in the conv state."""
        return (
            self.key_heads * self.key_dim,
            self.key_heads * self.key_dim,
            self.value_heads * self.value_dim,
        )


@dataclass(frozen=True)
class ModelGeometry:
    """What of a model's cache layout an engine needs."""

    architecture: str
    #: Per global layer: ``full``, ``sliding`` or ``linear``.
    layer_kinds: tuple[str, ...]
    kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    linear: LinearGeometry | None = None

    @classmethod
    def of(cls, config: Any) -> ModelGeometry:
        kinds = {
            "full_attention": "full",
            "sliding_attention": "sliding",
            "linear_attention": "linear",
        }
        types = (
            getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        )
        linear = None
        if "linear_attention" in types:
            linear = LinearGeometry(
                key_heads=config.linear_num_key_heads,
                value_heads=config.linear_num_value_heads,
                key_dim=config.linear_key_head_dim,
                value_dim=config.linear_value_head_dim,
                conv_kernel=config.linear_conv_kernel_dim,
            )
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        return cls(
            architecture=config.architectures[0],
            layer_kinds=tuple(kinds[t] for t in types),
            kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            sliding_window=getattr(config, "sliding_window", None)
            if "sliding_attention" in types
            else None,
            linear=linear,
        )

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def held_positions(self, kind: str, seq_len: int) -> range:
        """Token positions of a ``seq_len``-token cache that a layer of ``kind`` keeps:
        transformers' sliding-window layer keeps the last ``window - 1``."""
        if kind == "sliding":
            assert self.sliding_window is not None
            return range(max(0, seq_len - (self.sliding_window - 1)), seq_len)
        return range(seq_len)


# ---------------------------------------------------------------------------------------------
# Parallel mapping of an instance.


@dataclass(frozen=True)
class Topology:
    tp: int
    pp: int = 1

    @property
    def mapping(self) -> str:
        return f"tp{self.tp}" + (f"pp{self.pp}" if self.pp > 1 else "")

    @property
    def world(self) -> int:
        return self.tp * self.pp

    def coords(self, rank: int) -> tuple[int, int]:
        """(pp rank, tp rank) of an instance rank (``rank = pp × tp_size + tp``)."""
        return divmod(rank, self.tp)

    def layers_per_pp(self, num_layers: int) -> list[int]:
        base, extra = divmod(num_layers, self.pp)
        return [base + (1 if p < extra else 0) for p in range(self.pp)]

    def stage_layers(self, num_layers: int, pp_rank: int) -> range:
        split = self.layers_per_pp(num_layers)
        start = sum(split[:pp_rank])
        return range(start, start + split[pp_rank])


@dataclass(frozen=True)
class Shard:
    """Which of ``count`` things (heads, channel groups) a TP rank holds, and the shard and
    replica declaration kvferry reads (more ranks than things: replicas)."""

    first: int
    count: int
    num_shards: int
    shard_index: int
    num_replicas: int
    replica_index: int

    @classmethod
    def split(cls, total: int, tp: int, tp_rank: int) -> Shard:
        if total % tp and tp % total:
            raise ValueError(f"{total} heads cannot be split over {tp} ranks")
        num_shards = min(total, tp)
        num_replicas = tp // num_shards
        per = total // num_shards
        index = tp_rank // num_replicas
        return cls(index * per, per, num_shards, index, num_replicas, tp_rank % num_replicas)

    def slice(self) -> slice:
        return slice(self.first, self.first + self.count)

    def layout(self, kind: str, unit_bytes: int = 0, sections: list[int] | None = None) -> dict:
        out: dict[str, Any] = {
            "kind": kind,
            "dtype": "fp32",
            "elem_bits": 8 * ELEM,
            "num_shards": self.num_shards,
            "shard_index": self.shard_index,
            "num_replicas": self.num_replicas,
            "replica_index": self.replica_index,
            "shard_unit_bytes": unit_bytes,
        }
        if sections is not None:
            out["section_bytes"] = sections
        return out


# ---------------------------------------------------------------------------------------------
# One rank's pools and page table.


class Pool:
    """A float32 host pool of ``num_slots`` slots (NaN-filled), ``pad_elems`` floats of
    padding after each slot (a padded pool: ``slot_stride > slot_bytes``)."""

    def __init__(self, slot_elems: int, num_slots: int, pad_elems: int = 0):
        self.slot_elems = slot_elems
        self.stride_elems = slot_elems + pad_elems
        self.num_slots = num_slots
        self.array = np.full((num_slots, self.stride_elems), np.nan, dtype=np.float32)

    def slot(self, slot: int) -> np.ndarray:
        return self.array[slot, : self.slot_elems]

    def describe(self) -> dict:
        return {
            "base": self.array.ctypes.data,
            "slot_bytes": self.slot_elems * ELEM,
            "slot_stride": self.stride_elems * ELEM,
            "num_slots": self.num_slots,
            "memory_type": "dram",
        }


@dataclass
class PagedGroup:
    kind: str  # full | sliding
    layers: list[int]  # global ids, in slot order
    pool: Pool
    heads: Shard
    window: int | None


@dataclass
class StateGroup:
    layers: list[int]
    conv: Pool
    ssm: Pool
    channels: tuple[Shard, Shard, Shard]  # of the Q, K, V sections (in heads)
    value_heads: Shard


class RankCache:
    """One engine rank's KV memory under its mapping: pools, page table, and the copies
    between the model's cache tensors and the pools."""

    def __init__(
        self,
        model: ModelGeometry,
        topo: Topology,
        rank: int,
        *,
        tokens_per_block: int,
        layout: str,
        num_blocks: int,
        state_slots: int = 4,
        pad_elems: int = 0,
    ):
        if layout not in ("hnd", "nhd"):
            raise ValueError(f"layout must be hnd or nhd, not {layout!r}")
        self.model, self.topo, self.rank = model, topo, rank
        self.tpb, self.layout = tokens_per_block, layout
        self.pp_rank, self.tp_rank = topo.coords(rank)
        self.stage = topo.stage_layers(model.num_layers, self.pp_rank)
        heads = Shard.split(model.kv_heads, topo.tp, self.tp_rank)
        #: Whether this rank is the first TP replica of what it holds (the one whose pools the
        #: decode side reads when several ranks hold the same heads).
        self.first_replica = heads.replica_index == 0
        self.paged: list[PagedGroup] = []
        for kind in ("sliding", "full"):
            layers = [g for g in self.stage if model.layer_kinds[g] == kind]
            if layers:
                region = 2 * heads.count * tokens_per_block * model.head_dim
                self.paged.append(
                    PagedGroup(
                        kind,
                        layers,
                        Pool(region * len(layers), num_blocks, pad_elems),
                        heads,
                        model.sliding_window if kind == "sliding" else None,
                    )
                )
        self.state: StateGroup | None = None
        linear_layers = [g for g in self.stage if model.layer_kinds[g] == "linear"]
        if linear_layers:
            lin = model.linear
            assert lin is not None
            k_heads = Shard.split(lin.key_heads, topo.tp, self.tp_rank)
            v_heads = Shard.split(lin.value_heads, topo.tp, self.tp_rank)
            if k_heads.num_replicas != 1 or v_heads.num_replicas != 1:
                raise ValueError(
                    f"TP {topo.tp} replicates Gated DeltaNet heads ({lin.key_heads} key, "
                    f"{lin.value_heads} value): not simulated here"
                )
            conv_channels = 2 * k_heads.count * lin.key_dim + v_heads.count * lin.value_dim
            self.state = StateGroup(
                linear_layers,
                Pool(conv_channels * lin.conv_kernel * len(linear_layers), state_slots, pad_elems),
                Pool(v_heads.count * lin.key_dim * lin.value_dim * len(linear_layers), state_slots),
                (k_heads, k_heads, v_heads),
                v_heads,
            )

    # -- the page table ---------------------------------------------------------------------

    def pools(self) -> list[Pool]:
        out = [g.pool for g in self.paged]
        if self.state:
            out += [self.state.conv, self.state.ssm]
        return out

    def local(self, global_layer: int) -> int:
        return global_layer - self.stage.start

    def page_table(self) -> dict:
        groups = []
        pool_index = 0
        d = self.model.head_dim
        for g in self.paged:
            buf = g.heads.count * self.tpb * d * ELEM
            entries = []
            for i, layer in enumerate(g.layers):
                for kv in range(2):
                    entries.append(
                        {
                            "local_layer": self.local(layer),
                            "offset": (2 * i + kv) * buf,
                            "size": buf,
                        }
                    )
            unit = (self.tpb * d if self.layout == "hnd" else d) * ELEM
            group: dict[str, Any] = {
                "kind": "paged",
                "layers": [{"local": self.local(x), "global": x} for x in g.layers],
                "views": [
                    {
                        "pool": pool_index,
                        "roles": ["key", "value"],
                        "entries": entries,
                        "layout": g.heads.layout(self.layout, unit),
                    }
                ],
            }
            if g.window is not None:
                group["window"] = g.window
            groups.append(group)
            pool_index += 1
        if self.state:
            s, lin = self.state, self.model.linear
            assert lin is not None
            dims = (lin.key_dim, lin.key_dim, lin.value_dim)
            sections = [
                sh.count * dim * lin.conv_kernel * ELEM for sh, dim in zip(s.channels, dims)
            ]
            conv_layer = sum(sections)
            ssm_head = lin.key_dim * lin.value_dim * ELEM
            ssm_layer = s.value_heads.count * ssm_head
            groups.append(
                {
                    "kind": "state",
                    "layers": [{"local": self.local(x), "global": x} for x in s.layers],
                    "views": [
                        {
                            "pool": pool_index,
                            "roles": ["conv"],
                            "entries": [
                                {
                                    "local_layer": self.local(x),
                                    "offset": i * conv_layer,
                                    "size": conv_layer,
                                }
                                for i, x in enumerate(s.layers)
                            ],
                            # Sharded as the value heads are: a rank's K/Q channels follow its
                            # key heads, which the value heads group under.
                            "layout": s.value_heads.layout("sectioned", 0, sections),
                        },
                        {
                            "pool": pool_index + 1,
                            "roles": ["ssm"],
                            "entries": [
                                {
                                    "local_layer": self.local(x),
                                    "offset": i * ssm_layer,
                                    "size": ssm_layer,
                                }
                                for i, x in enumerate(s.layers)
                            ],
                            "layout": s.value_heads.layout("hnd", ssm_head),
                        },
                    ],
                }
            )
        return {
            "tokens_per_block": self.tpb,
            "pools": [p.describe() for p in self.pools()],
            "groups": groups,
        }

    # -- copies between the model's cache and the pools ------------------------------------

    def _buffers(self, group: PagedGroup, slot: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V buffers of ``layer`` in ``slot``, as ``[head][token][dim]`` arrays (NHD:
        a transposed view of ``[token][head][dim]``)."""
        h, d = group.heads.count, self.model.head_dim
        i = group.layers.index(layer)
        buf = h * self.tpb * d
        row = group.pool.slot(slot)
        out = []
        for kv in range(2):
            flat = row[(2 * i + kv) * buf : (2 * i + kv + 1) * buf]
            if self.layout == "hnd":
                out.append(flat.reshape(h, self.tpb, d))
            else:
                out.append(flat.reshape(self.tpb, h, d).transpose(1, 0, 2))
        return out[0], out[1]

    def write_kv(
        self,
        group: PagedGroup,
        table: list[int],
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: range,
        only: range | None = None,
    ) -> None:
        """Stores the rank's heads of ``keys``/``values`` (``[1, heads, len(positions), dim]``,
        the model's full per-layer tensors holding ``positions``) into the blocks of
        ``table``; ``only``: the positions to store (default all)."""
        want = (
            positions
            if only is None
            else range(max(positions.start, only.start), min(positions.stop, only.stop))
        )
        heads = group.heads.slice()
        k = keys[0, heads].numpy()
        v = values[0, heads].numpy()
        for block in range(want.start // self.tpb, math.ceil(want.stop / self.tpb)):
            lo, hi = max(want.start, block * self.tpb), min(want.stop, (block + 1) * self.tpb)
            if lo >= hi:
                continue
            kb, vb = self._buffers(group, table[block], layer)
            t = slice(lo - block * self.tpb, hi - block * self.tpb)
            src = slice(lo - positions.start, hi - positions.start)
            kb[:, t] = k[:, src]
            vb[:, t] = v[:, src]

    def read_kv(self, group: PagedGroup, table: list[int], layer: int, positions: range):
        """The rank's heads of ``layer`` at ``positions``: ``[heads, len, dim]`` K and V."""
        h, d = group.heads.count, self.model.head_dim
        k = np.empty((h, len(positions), d), dtype=np.float32)
        v = np.empty_like(k)
        for block in range(positions.start // self.tpb, math.ceil(positions.stop / self.tpb)):
            lo = max(positions.start, block * self.tpb)
            hi = min(positions.stop, (block + 1) * self.tpb)
            kb, vb = self._buffers(group, table[block], layer)
            t = slice(lo - block * self.tpb, hi - block * self.tpb)
            dst = slice(lo - positions.start, hi - positions.start)
            k[:, dst] = kb[:, t]
            v[:, dst] = vb[:, t]
        return k, v

    def _state_regions(self, slot: int, layer: int) -> tuple[list[np.ndarray], np.ndarray]:
        s, lin = self.state, self.model.linear
        assert s is not None and lin is not None
        i = s.layers.index(layer)
        dims = (lin.key_dim, lin.key_dim, lin.value_dim)
        per = [sh.count * dim for sh, dim in zip(s.channels, dims)]
        conv_layer = sum(per) * lin.conv_kernel
        row = s.conv.slot(slot)[i * conv_layer : (i + 1) * conv_layer].reshape(
            sum(per), lin.conv_kernel
        )
        sections, at = [], 0
        for n in per:
            sections.append(row[at : at + n])
            at += n
        ssm_layer = s.value_heads.count * lin.key_dim * lin.value_dim
        ssm = s.ssm.slot(slot)[i * ssm_layer : (i + 1) * ssm_layer].reshape(
            s.value_heads.count, lin.key_dim, lin.value_dim
        )
        return sections, ssm

    def write_state(
        self, slot: int, layer: int, conv: torch.Tensor, recurrent: torch.Tensor
    ) -> None:
        """Stores the rank's channels of the conv state ``[1, conv_dim, kernel]`` and its value
        heads of the recurrent state ``[1, value heads, key dim, value dim]``."""
        s, lin = self.state, self.model.linear
        assert s is not None and lin is not None
        sections, ssm = self._state_regions(slot, layer)
        full = conv[0].numpy()
        at = 0
        for sec, sh, dim, total in zip(
            sections, s.channels, (lin.key_dim, lin.key_dim, lin.value_dim), lin.sections()
        ):
            sec[:] = full[at + sh.first * dim : at + (sh.first + sh.count) * dim]
            at += total
        ssm[:] = recurrent[0, s.value_heads.slice()].numpy()

    def read_state(self, slot: int, layer: int) -> tuple[list[np.ndarray], np.ndarray]:
        sections, ssm = self._state_regions(slot, layer)
        return [sec.copy() for sec in sections], ssm.copy()


# ---------------------------------------------------------------------------------------------
# An instance: its ranks, their block tables and their agents.


@dataclass
class Request:
    """One request's slots on one instance: a block table per PAGED group kind (shared by
    every rank, as a scheduler's block table is) and a recurrent-state slot."""

    blocks: dict[str, list[int]] = field(default_factory=dict)
    state_slot: int = -1


class Instance:
    """An engine instance: ``topo.world`` ranks, each with its pools and its agent."""

    def __init__(
        self,
        name: str,
        role: str,
        model: ModelGeometry,
        topo: Topology,
        *,
        tokens_per_block: int,
        layout: str,
        num_blocks: int,
        seed: int,
        pad_elems: int = 0,
    ):
        self.name, self.role, self.model, self.topo = name, role, model, topo
        self.tpb = tokens_per_block
        self.num_blocks = num_blocks
        self.rng = np.random.default_rng(seed)
        self.ranks = [
            RankCache(
                model,
                topo,
                r,
                tokens_per_block=tokens_per_block,
                layout=layout,
                num_blocks=num_blocks,
                pad_elems=pad_elems,
            )
            for r in range(topo.world)
        ]
        self.agents: list[kvferry.Agent] = []

    def start(self, plugin_dir: str, transport: str) -> None:
        for rank in self.ranks:
            config = {
                "version": kvferry.CONFIG_VERSION,
                "instance": self.name,
                "role": self.role,
                "label": f"{self.model.architecture} e2e {self.topo.mapping} rank {rank.rank}",
                "architecture": self.model.architecture,
                "planner": "kvferry.default",
                "plugin_dir": plugin_dir,
                "transport": transport,
                "listen": "127.0.0.1:0",
                "secret": SECRET,
                "timeout_ms": 30000,
                "lease_ms": 30000,
                "rank": {
                    "mapping": self.topo.mapping,
                    "instance_rank": rank.rank,
                    "layers_per_pp": self.topo.layers_per_pp(self.model.num_layers),
                    "page_table": rank.page_table(),
                },
            }
            pools = [p.array for p in rank.pools()]
            self.agents.append(kvferry.Agent(json.dumps(config), keep_alive=pools))

    def close(self) -> None:
        for agent in self.agents:
            agent.close()

    def endpoints(self) -> list[str]:
        out = [a.endpoint() for a in self.agents]
        assert all(out), "a prefill rank without an endpoint"
        return [e for e in out if e]

    def allocate(self, prompt_len: int) -> Request:
        """Scattered blocks for every PAGED group kind, a state slot if the model has state."""
        n = math.ceil(prompt_len / self.tpb)
        req = Request()
        for kind in ("sliding", "full"):
            if kind in self.model.layer_kinds:
                req.blocks[kind] = [int(b) for b in self.rng.permutation(self.num_blocks)[:n]]
        if "linear" in self.model.layer_kinds:
            req.state_slot = int(self.rng.integers(0, 4))
        return req

    def tables(
        self, rank: RankCache, req: Request, token_end: int, prompt_len: int, state: bool = True
    ) -> list[np.ndarray]:
        """The rank's slot tables, one per group of its page table, covering blocks up to
        ``token_end``; blocks a sliding-window group no longer holds at ``prompt_len`` are -1.
        The STATE group's table is the request's slot, or empty without ``state`` (a chunk
        before the last: the state is final only once the whole prompt is in)."""
        n = math.ceil(token_end / self.tpb)
        out = []
        for g in rank.paged:
            table = np.array(req.blocks[g.kind][:n], dtype=np.int32)
            if g.kind == "sliding":
                first = self.model.held_positions("sliding", prompt_len).start // self.tpb
                table[: min(first, n)] = -1
            out.append(table)
        if rank.state:
            out.append(np.array([req.state_slot] if state else [], dtype=np.int32))
        return out

    # -- the model's cache in and out of the pools -----------------------------------------

    def store(
        self, req: Request, cache: Any, new: range, prompt_len: int, state: bool = True
    ) -> None:
        """Writes positions ``new`` of every layer of ``cache`` (a transformers cache holding
        positions ``[0, new.stop)``) that a rank holds into its pools, and with ``state``
        every rank's share of the recurrent state."""
        for rank in self.ranks:
            for g in rank.paged:
                for layer in g.layers:
                    entry = cache.layers[layer]
                    held = self.model.held_positions(g.kind, new.stop)
                    keep = self.model.held_positions(g.kind, prompt_len)
                    only = range(max(new.start, keep.start), new.stop)
                    rank.write_kv(
                        g, req.blocks[g.kind], layer, entry.keys, entry.values, held, only
                    )
            if rank.state and state:
                for layer in rank.state.layers:
                    entry = cache.layers[layer]
                    rank.write_state(
                        req.state_slot, layer, entry.conv_states[0], entry.recurrent_states[0]
                    )

    def assemble(self, req: Request, prompt_len: int, config: Any) -> Any:
        """The model's cache of a ``prompt_len``-token prompt, built from this instance's
        pools alone (each layer from the ranks of its PP stage, heads and channels
        concatenated over TP ranks, one replica each)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=config)
        for layer, kind in enumerate(self.model.layer_kinds):
            owners = sorted(
                (r for r in self.ranks if layer in r.stage and r.first_replica),
                key=lambda r: r.tp_rank,
            )
            target = cache.layers[layer]
            if kind == "linear":
                convs: list[list[np.ndarray]] = [[], [], []]
                ssms = []
                for r in owners:
                    sections, ssm = r.read_state(req.state_slot, layer)
                    for i, sec in enumerate(sections):
                        convs[i].append(sec)
                    ssms.append(ssm)
                conv = torch.from_numpy(np.concatenate([np.concatenate(c) for c in convs]))[None]
                rec = torch.from_numpy(np.concatenate(ssms))[None]
                target.update_conv_state(conv, conv_kernel_size=conv.shape[-1])
                target.update_recurrent_state(rec)
                continue
            positions = self.model.held_positions(kind, prompt_len)
            ks, vs = [], []
            for r in owners:
                group = next(g for g in r.paged if layer in g.layers)
                k, v = r.read_kv(group, req.blocks[kind], layer, positions)
                ks.append(k)
                vs.append(v)
            keys = torch.from_numpy(np.concatenate(ks))[None]
            values = torch.from_numpy(np.concatenate(vs))[None]
            target.lazy_initialization(keys, values)
            target.keys, target.values = keys, values
            if kind == "sliding":
                target.cumulative_length = prompt_len
        return cache


def wait_all(
    agents: list[kvferry.Agent], request: int, limit_s: float = 60.0
) -> list[kvferry.Event]:
    """Each agent's terminal event of ``request``, waiting on their wake descriptors."""
    got: dict[int, kvferry.Event] = {}
    fds = {a.wake_fd(): i for i, a in enumerate(agents)}
    deadline = time.monotonic() + limit_s
    while len(got) < len(agents):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"request {request}: events so far {got}")
        ready, _, _ = select.select(list(fds), [], [], left)
        for fd in ready:
            i = fds[fd]
            for event in agents[i].poll():
                assert event.request == request, f"unexpected {event!r}"
                assert i not in got, f"two terminal events: {event!r}"
                got[i] = event
    return [got[i] for i in range(len(agents))]
