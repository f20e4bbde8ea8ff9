"""Agent configurations from the engine's own cache tensors: no hand-written page tables.

:func:`describe_paged_cache` reads a paged KV cache — one tensor per layer, or a ``(key,
value)`` pair per layer, torch tensors on the CPU or a CUDA device, or numpy arrays — checks
its shape, dtype, device and strides, and returns the ``rank`` object of the agent's
configuration (``host/capi/README.md``, "The configuration"): one pool per tensor (slot =
block, in place: nothing is copied), one layer group, the views and their sharding.
:func:`agent_config` wraps it into the JSON :class:`kvferry.Agent` takes. :func:`pool` and
:func:`pool_from_pointer` describe single pools for page tables built by hand.

The block interior (``layout``) is ``"hnd"`` (``[head][token][dim]``, vLLM's CPU and
FlashInfer layouts) or ``"nhd"`` (``[token][head][dim]``, FlashAttention's). K and V (``kv``)
are ``"split"`` (a tensor ``[blocks, 2, <interior>]``: K then V in each block), ``"fused"``
(``[blocks, <interior>]`` whose last dimension holds ``K|V``, ``2 * head_size`` elements, as
vLLM's CPU cache does), or separate tensors (pass ``(key, value)`` per layer; a FlashAttention
cache ``[2, blocks, ...]`` is ``(cache[0], cache[1])``).

Every tensor passed must stay alive, at its address, for the agent's life: pass them as the
agent's ``keep_alive``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ._kvferry import CONFIG_VERSION

__all__ = [
    "RankDescription",
    "agent_config",
    "describe_paged_cache",
    "pool",
    "pool_from_pointer",
]

#: Element types: the name torch or numpy gives them -> (kvferry's dtype, bits).
_DTYPES = {
    "float32": ("fp32", 32),
    "float16": ("fp16", 16),
    "bfloat16": ("bf16", 16),
    "float8_e4m3fn": ("fp8_e4m3", 8),
    "float8_e5m2": ("fp8_e5m2", 8),
    "uint8": ("u8", 8),
}


class RankDescription(dict):
    """The ``rank`` object (a dict), and the CUDA device its pools are on (``None``: host
    memory), which :func:`agent_config` puts in the configuration."""

    cuda_device: int | None = None


class _Tensor:
    """What kvferry needs of a torch tensor or a numpy array: address, element size and
    type, shape, strides in bytes, and device."""

    def __init__(self, t: Any, what: str):
        self.what = what
        if hasattr(t, "data_ptr") and hasattr(t, "element_size"):  # torch
            self.base = int(t.data_ptr())
            self.elem = int(t.element_size())
            self.shape = tuple(int(n) for n in t.shape)
            self.strides = tuple(int(s) * self.elem for s in t.stride())
            self.dtype = str(t.dtype).removeprefix("torch.")
            device = t.device
            self.device = device.type
            self.device_index = device.index if device.type == "cuda" else None
            if self.device == "cuda" and self.device_index is None:
                self.device_index = 0
        elif hasattr(t, "__array_interface__") and hasattr(t, "strides"):  # numpy
            self.base = int(t.__array_interface__["data"][0])
            self.elem = int(t.itemsize)
            self.shape = tuple(int(n) for n in t.shape)
            self.strides = tuple(int(s) for s in t.strides)
            self.dtype = str(t.dtype)
            self.device, self.device_index = "cpu", None
        else:
            raise TypeError(
                f"{what}: a torch tensor or a numpy array, not {type(t).__name__}"
            )
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"{what}: on {self.device}; kvferry takes CPU or CUDA memory")

    @property
    def memory_type(self) -> str:
        return "vram" if self.device == "cuda" else "dram"

    def kvferry_dtype(self) -> tuple[str, int]:
        try:
            return _DTYPES[self.dtype]
        except KeyError:
            raise ValueError(
                f"{self.what}: dtype {self.dtype} is not one kvferry describes "
                f"({', '.join(_DTYPES)})"
            ) from None


def pool_from_pointer(
    base: int,
    slot_bytes: int,
    num_slots: int,
    *,
    slot_stride: int | None = None,
    cuda_device: int | None = None,
) -> dict[str, Any]:
    """One pool of a page table from a raw address: ``num_slots`` slots of ``slot_bytes``,
    ``slot_stride`` apart (default: back to back), in host memory or on CUDA device
    ``cuda_device`` (give the same one to the agent's ``cuda_device``)."""
    for name, value in (("slot_bytes", slot_bytes), ("num_slots", num_slots)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, not {value!r}")
    stride = slot_bytes if slot_stride is None else slot_stride
    if stride < slot_bytes:
        raise ValueError(f"slot_stride {stride} is smaller than slot_bytes {slot_bytes}")
    if not isinstance(base, int) or base <= 0:
        raise ValueError(f"base must be a non-null address, not {base!r}")
    return {
        "base": base,
        "slot_bytes": slot_bytes,
        "slot_stride": stride,
        "num_slots": num_slots,
        "memory_type": "dram" if cuda_device is None else "vram",
    }


def pool(t: Any, *, what: str = "pool") -> dict[str, Any]:
    """One pool from a tensor or array whose first dimension is the slot (block) and whose
    remaining dimensions are contiguous: slot bytes = one slot's elements, stride = the first
    dimension's."""
    return _pool_of(_Tensor(t, what))


def _pool_of(x: _Tensor) -> dict[str, Any]:
    _check_contiguous_interior(x, 1)
    slot_bytes = _prod(x.shape[1:]) * x.elem
    return pool_from_pointer(
        x.base,
        slot_bytes,
        x.shape[0],
        slot_stride=x.strides[0],
        cuda_device=x.device_index,
    )


def _prod(dims: Sequence[int]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def _check_contiguous_interior(x: _Tensor, first: int) -> None:
    """Dimensions ``first..`` of ``x`` are C-contiguous."""
    want = x.elem
    for dim in range(len(x.shape) - 1, first - 1, -1):
        if x.shape[dim] != 1 and x.strides[dim] != want:
            raise ValueError(
                f"{x.what}: dimensions {first}.. of shape {x.shape} are not contiguous "
                f"(strides in bytes {x.strides})"
            )
        want *= x.shape[dim]
    if x.shape and x.shape[0] > 1 and first == 1 and x.strides[0] < want:
        raise ValueError(
            f"{x.what}: blocks overlap (stride {x.strides[0]} bytes, block {want} bytes)"
        )


def describe_paged_cache(
    caches: Sequence[Any],
    *,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    value_head_size: int | None = None,
    layout: str = "hnd",
    kv: str = "split",
    tp_size: int = 1,
    tp_rank: int = 0,
    total_kv_heads: int | None = None,
    layers: Sequence[int] | None = None,
    mapping: str | None = None,
    instance_rank: int | None = None,
    layers_per_pp: Sequence[int] | None = None,
    names: Sequence[str] | None = None,
) -> RankDescription:
    """The ``rank`` object of an agent's configuration for a paged KV cache.

    ``caches``: one entry per layer this rank holds, in order: a tensor (``kv="split"``:
    ``[blocks, 2, <interior>]``; ``kv="fused"``: ``[blocks, <interior>]`` with ``K|V`` in the
    last dimension) or a ``(key, value)`` pair of ``[blocks, <interior>]`` tensors. The
    interior is ``[num_kv_heads, block_size, head_size]`` (``layout="hnd"``) or
    ``[block_size, num_kv_heads, head_size]`` (``"nhd"``); every layer has the same number of
    blocks (one slot table indexes them all), dtype and device. ``value_head_size``: V's
    elements per head when they differ from K's (``kv="fused"`` only: the last dimension is
    then ``head_size + value_head_size``). ``names``: what to call each layer in errors
    (default ``layer N``).

    Sharding: ``tp_size`` and ``tp_rank`` (this rank holds ``num_kv_heads`` of
    ``total_kv_heads``, default ``num_kv_heads * tp_size``; fewer KV heads than ranks are
    replicated, as engines do). ``layers``: the model's index of each layer (default
    ``0..``); ``mapping`` (default ``tp{tp_size}``), ``instance_rank`` (default ``tp_rank``)
    and ``layers_per_pp`` (default ``[len(caches)]``) for pipeline-parallel deployments.

    Raises ``ValueError`` (``TypeError`` for something that is not a tensor) naming the layer
    and what does not fit.
    """
    if layout not in ("hnd", "nhd"):
        raise ValueError(f'layout must be "hnd" or "nhd", not {layout!r}')
    if kv not in ("split", "fused"):
        raise ValueError(f'kv must be "split" or "fused", not {kv!r}')
    for name, value in (
        ("block_size", block_size),
        ("num_kv_heads", num_kv_heads),
        ("head_size", head_size),
        ("tp_size", tp_size),
    ):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, not {value!r}")
    if not caches:
        raise ValueError("no layers: caches is empty")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is not in 0..{tp_size}")
    total = num_kv_heads * tp_size if total_kv_heads is None else total_kv_heads
    shards = min(total, tp_size)
    replicas = tp_size // shards
    if num_kv_heads * shards != total or shards * replicas != tp_size:
        raise ValueError(
            f"{num_kv_heads} KV heads on this rank do not shard {total} over TP {tp_size}"
        )
    if layers is not None and len(layers) != len(caches):
        raise ValueError(f"{len(layers)} layer indices for {len(caches)} layers")
    if names is not None and len(names) != len(caches):
        raise ValueError(f"{len(names)} layer names for {len(caches)} layers")
    value_size = head_size if value_head_size is None else value_head_size
    if value_size != head_size and kv != "fused":
        raise ValueError(
            f'value_head_size {value_size} differs from head_size {head_size}: kv="fused" only'
        )

    interior = (
        (num_kv_heads, block_size, head_size)
        if layout == "hnd"
        else (block_size, num_kv_heads, head_size)
    )
    pools: list[dict[str, Any]] = []
    views: list[dict[str, Any]] = []
    first: _Tensor | None = None

    def add_pool(t: Any, what: str, shape_after_blocks: tuple[int, ...]) -> tuple[int, _Tensor]:
        nonlocal first
        x = _Tensor(t, what)
        if len(x.shape) != 1 + len(shape_after_blocks) or x.shape[1:] != shape_after_blocks:
            raise ValueError(
                f"{what}: shape {x.shape}, expected (blocks, {', '.join(map(str, shape_after_blocks))})"
                f" for {layout}, kv={kv!r}"
            )
        if first is None:
            first = x
        elif (x.dtype, x.device, x.device_index, x.shape[0]) != (
            first.dtype,
            first.device,
            first.device_index,
            first.shape[0],
        ):
            raise ValueError(
                f"{what}: {x.shape[0]} blocks of {x.dtype} on {x.device}"
                f"{'' if x.device_index is None else f':{x.device_index}'}; the first layer has "
                f"{first.shape[0]} of {first.dtype} on {first.device}"
                f"{'' if first.device_index is None else f':{first.device_index}'}"
            )
        pools.append(_pool_of(x))
        return len(pools) - 1, x

    pairs = [isinstance(entry, (tuple, list)) for entry in caches]
    if any(pairs) and not all(pairs):
        raise ValueError(
            f"layer {pairs.index(not pairs[0])}: every layer a (key, value) pair, or every layer "
            "one tensor"
        )
    for local, entry in enumerate(caches):
        what = f"layer {local}" if names is None else str(names[local])
        if pairs[0]:
            if len(entry) != 2:
                raise ValueError(f"{what}: a (key, value) pair, not {len(entry)} tensors")
            for role, t in zip(("key", "value"), entry):
                index, x = add_pool(t, f"{what} {role}", interior)
                views.append({
                    "pool": index,
                    "roles": [role],
                    "entries": [
                        {"local_layer": local, "offset": 0, "size": _prod(interior) * x.elem}
                    ],
                })
        elif kv == "split":
            index, x = add_pool(entry, what, (2, *interior))
            half = _prod(interior) * x.elem
            views.append({
                "pool": index,
                "roles": ["key", "value"],
                "entries": [
                    {"local_layer": local, "offset": 0, "size": half},
                    {"local_layer": local, "offset": half, "size": half},
                ],
            })
        else:
            fused = (*interior[:-1], head_size + value_size)
            index, x = add_pool(entry, what, fused)
            views.append({
                "pool": index,
                "roles": ["key", "value"],
                "entries": [
                    {"local_layer": local, "offset": 0, "size": _prod(fused) * x.elem}
                ],
            })
    assert first is not None
    dtype, bits = first.kvferry_dtype()
    # The elements of one head of one token in a view's entry.
    content = head_size + value_size if kv == "fused" and not pairs[0] else head_size
    view_layout = {
        "kind": layout,
        "dtype": dtype,
        "elem_bits": bits,
        "num_shards": shards,
        "shard_index": tp_rank // replicas,
        "num_replicas": replicas,
        "replica_index": tp_rank % replicas,
        # HND: one head's block of a role; NHD: one head of one token.
        "shard_unit_bytes": (block_size if layout == "hnd" else 1) * content * first.elem,
    }
    for view in views:
        view["layout"] = view_layout
    global_layers = list(range(len(caches))) if layers is None else list(layers)
    rank = RankDescription({
        "mapping": mapping or f"tp{tp_size}",
        "instance_rank": tp_rank if instance_rank is None else instance_rank,
        "layers_per_pp": list(layers_per_pp) if layers_per_pp else [len(caches)],
        "page_table": {
            "tokens_per_block": block_size,
            "pools": pools,
            "groups": [{
                "kind": "paged",
                "layers": [
                    {"local": local, "global": g} for local, g in enumerate(global_layers)
                ],
                "views": views,
            }],
        },
    })
    rank.cuda_device = first.device_index
    return rank


def agent_config(
    *,
    instance: str,
    role: str,
    architecture: str,
    rank: dict[str, Any],
    **fields: Any,
) -> str:
    """The JSON configuration :class:`kvferry.Agent` takes: ``rank`` (from
    :func:`describe_paged_cache`) and any other field of the configuration (``secret``,
    ``planner``, ``plugin_dir``, ``transport``, ``listen``, ``timeout_ms``, ... — a field the
    agent does not know is refused by name when it starts). ``cuda_device`` is that of the
    tensors :func:`describe_paged_cache` described, unless given."""
    device = getattr(rank, "cuda_device", None)
    if device is not None:
        fields.setdefault("cuda_device", device)
    config: dict[str, Any] = {
        "version": CONFIG_VERSION,
        "instance": instance,
        "role": role,
        "architecture": architecture,
        "rank": rank,
    }
    config.update(fields)
    return json.dumps(config)
