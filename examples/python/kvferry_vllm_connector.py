"""A vLLM-shaped KV connector on the kvferry agent, without vLLM.

``KVFerryConnector`` has the methods of vLLM's ``KVConnectorBase_V1``
(``vllm/distributed/kv_transfer/kv_connector/v1/base.py``), scheduler side and worker side,
with vLLM's semantics for disaggregated prefill (the NIXL connector's protocol):

* The prefill instance (``kv_producer``): a request that arrives with
  ``kv_transfer_params={"do_remote_decode": True}`` is prefilled; at its end the scheduler
  calls :meth:`~KVFerryConnector.request_finished`, which answers ``delay_free=True`` and the
  ``kv_transfer_params`` the decode instance gets with its request (the prefill instance's
  name, its ranks' endpoints, the prompt length, the request id and kvferry's id of it). The
  next step's :class:`KVFerryConnectorMetadata` tells the worker to ``send`` the prompt's
  blocks; the scheduler frees them only once :meth:`~KVFerryConnector.get_finished` reports
  the request in ``finished_sending`` (the agent's ``sent``, ``failed`` or ``cancelled``
  event: kvferry no longer reads them).
* The decode instance (``kv_consumer``): :meth:`~KVFerryConnector.get_num_new_matched_tokens`
  reports the remote prompt tokens beyond the locally computed (prefix-cached) ones as
  loadable asynchronously (``(n, True)``), :meth:`~KVFerryConnector.update_state_after_alloc`
  records the block ids the scheduler allocated, the worker's
  :meth:`~KVFerryConnector.start_load_kv` calls the agent's ``expect`` into them, and
  :meth:`~KVFerryConnector.get_finished` reports the request in ``finished_recving`` after
  ``received``. A failed load (the agent's ``failed``/``cancelled`` event, or an ``expect``
  the agent refuses) is logged and reported in ``finished_recving`` too — never left hanging:
  every kvferry request ends in exactly one terminal event, by its deadline (``timeout_ms``)
  at the latest — with an entry in :meth:`~KVFerryConnector.take_transfer_errors` and its
  blocks in :meth:`~KVFerryConnector.get_block_ids_with_load_errors` (vLLM then recomputes).

In vLLM the scheduler side and the worker side are two objects (``KVConnectorRole.SCHEDULER``
in the engine core, ``KVConnectorRole.WORKER`` in every worker) and the metadata crosses a
process boundary; here one object of one role (producer or consumer) is both, and the
metadata is a plain dataclass (it pickles). ``request`` arguments need vLLM ``Request``'s
``request_id``, ``prompt_token_ids`` (or ``num_prompt_tokens``) and ``kv_transfer_params``;
``blocks`` is a ``KVCacheBlocks`` (anything with ``get_block_ids()``), a tuple of lists or a
list of block ids.

**KV caches.** :meth:`~KVFerryConnector.register_kv_caches` takes vLLM's per-layer paged
caches, ``{layer_name: array}``, every array C-contiguous with the same shape and dtype:

* ``kv_shape="kv_first"`` (default; vLLM's FlashAttention backend):
  ``(2, num_blocks, block_size, num_kv_heads, head_size)`` for ``kv_layout="NHD"`` (default),
  ``(2, num_blocks, num_kv_heads, block_size, head_size)`` for ``kv_layout="HND"``. K and V of
  a block are not adjacent, so each layer's K buffer and V buffer is a kvferry pool of its own
  (``2 x layers`` pools; slot = block, ``slot_bytes`` = one block of K or V), and each pool has
  one view (roles ``["key"]`` or ``["value"]``).
* ``kv_shape="blocks_first"`` (vLLM's FlashInfer backend): ``(num_blocks, 2, block_size,
  num_kv_heads, head_size)`` (NHD) or ``(num_blocks, 2, num_kv_heads, block_size, head_size)``
  (HND): one pool per layer, one view ``["key", "value"]`` with two entries (K then V).

Either way it is one PAGED layer group over every layer, so a slot table is exactly vLLM's
block id list. ``kvferry.default`` maps between the two sides' block ids, pools and GQA head
shards (``tp_size``/``tp_rank`` declare this worker's shard of the KV heads as
``num_shards``/``shard_index``); both sides must use the same ``kv_layout`` and ``kv_shape``
(the planner pairs views by role set and refuses different layout kinds). Layer order
is the layer index in vLLM's layer names (``model.layers.3.self_attn.attn`` → global layer
3). numpy arrays in host memory only (``memory_type: dram``); numpy has no bfloat16, so a
bf16 cache is registered as a ``uint16`` (or ``float16``) array with ``dtype="bf16"``.

**Config** (vLLM's ``kv_connector_extra_config``): ``instance`` (this instance's name, what a
decode instance names the prefill by), ``plugin_dir``, ``secret``; optional ``transport``
(``tcp``), ``listen`` (``0.0.0.0:0``), ``advertise``, ``architecture``
(``LlamaForCausalLM``), ``kv_layout``, ``kv_shape``, ``dtype`` (from the array's dtype),
``tp_size``/``tp_rank`` (1/0; one connector per worker, every worker of an instance with the
same ``instance``), ``endpoints`` (producer, scheduler side: the side-channel endpoints of all
of the instance's workers, any order, that ``kv_transfer_params`` hands the decode; default:
this worker's own, enough at TP 1), ``dp_rank`` (the prefill's attention-DP rank the
decode names, 0), ``timeout_ms``, ``lease_ms`` (how long a prefill's send
waits for its decode), and ``agent``: more fields of the agent's JSON configuration, verbatim
(``host/capi/README.md``).

Not covered: pipeline parallelism, several KV cache groups (hybrid models), chunked sends
(every request is sent whole when it finishes; ``save_kv_layer`` is a no-op because kvferry
reads the paged cache in place), torch/VRAM tensors, and vLLM's handshake and KV events.
Aggregating the workers' ``get_finished`` answers (vLLM's ``KVOutputAggregator``) is the engine's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvferry

logger = logging.getLogger("kvferry.vllm_connector")

PRODUCER, CONSUMER = "kv_producer", "kv_consumer"
_ROLES = {
    "kv_producer": PRODUCER,
    "producer": PRODUCER,
    "kv_consumer": CONSUMER,
    "consumer": CONSUMER,
}
_DTYPES = {
    np.dtype(np.float16): "fp16",
    np.dtype(np.float32): "fp32",
}


def kvferry_request_id(instance: str, request_id: str) -> int:
    """kvferry's integer id of a vLLM request (63 bits of a hash of the prefill instance's
    name and the request id): both sides derive it, or read it from ``kv_transfer_params``."""
    digest = hashlib.blake2b(f"{instance}/{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def layer_index(name: str) -> int:
    """The layer index in a vLLM layer name (the one integer among its dotted parts)."""
    numbers = [int(part) for part in name.split(".") if re.fullmatch(r"\d+", part)]
    if len(numbers) != 1:
        raise ValueError(f"layer name {name!r} has {len(numbers)} integer parts, not one")
    return numbers[0]


def _block_ids(blocks: Any) -> list[int]:
    """The block ids of the (single) KV cache group of ``blocks``."""
    if hasattr(blocks, "get_block_ids"):
        blocks = blocks.get_block_ids()
    if isinstance(blocks, tuple):
        if len(blocks) != 1:
            raise ValueError(f"{len(blocks)} KV cache groups; this connector handles one")
        blocks = blocks[0]
    return [int(b) for b in blocks]


def _prompt_len(request: Any) -> int:
    n = getattr(request, "num_prompt_tokens", None)
    return int(n) if n is not None else len(request.prompt_token_ids)


@dataclass
class ReqMeta:
    """One request the worker acts on this step."""

    request_id: str
    #: kvferry's id of it (:func:`kvferry_request_id` of the prefill instance and request id).
    transfer_id: int
    #: vLLM's block ids, covering tokens ``[0, prompt_len)`` (and maybe more).
    block_ids: list[int]
    prompt_len: int
    #: Consumer: tokens already here (a block-aligned local prefix-cache hit), not written.
    cached_tokens: int = 0
    #: Consumer: the prefill instance's name and its ranks' side-channel endpoints.
    remote_instance: str = ""
    remote_endpoints: list[str] = field(default_factory=list)
    remote_dp_rank: int = 0


@dataclass
class KVFerryConnectorMetadata:
    """What the scheduler side tells the worker side each step (vLLM's
    ``KVConnectorMetadata``): requests to load (consumer) and to send (producer)."""

    reqs_to_recv: dict[str, ReqMeta] = field(default_factory=dict)
    reqs_to_send: dict[str, ReqMeta] = field(default_factory=dict)


@dataclass
class TransferError:
    """A request whose transfer failed: it is still reported finished (sending or receiving)."""

    request_id: str
    #: The agent's event kind (``failed``, ``cancelled``) or ``refused`` (the call raised).
    kind: str
    #: The event's ``failure_kind`` or the exception's ``kind``.
    failure_kind: str | None
    detail: str


class KVFerryConnector:
    """A vLLM ``KVConnectorBase_V1``-shaped connector for one rank, on a ``kvferry.Agent``.

    ``role``: ``"kv_producer"`` (prefill; the agent is a context rank) or ``"kv_consumer"``
    (decode; a generation rank). ``config``: see the module's docs. The agent starts in
    :meth:`register_kv_caches`, when the pools are known.
    """

    def __init__(self, role: str, config: dict[str, Any]):
        if role not in _ROLES:
            raise ValueError(f"role must be kv_producer or kv_consumer, not {role!r}")
        self.role = _ROLES[role]
        self.config = dict(config)
        self.instance: str = self.config["instance"]
        self.agent: kvferry.Agent | None = None
        self.block_size = 0
        self._connector_metadata: KVFerryConnectorMetadata | None = None
        # Scheduler side: what the next build_connector_meta hands the worker.
        self._reqs_need_recv: dict[str, ReqMeta] = {}
        self._reqs_need_send: dict[str, ReqMeta] = {}
        # Worker side: requests the agent holds, by kvferry id, and their outcomes.
        self._in_flight: dict[int, ReqMeta] = {}
        self._done_sending: dict[str, ReqMeta] = {}  # ended, not reported yet
        self._done_recving: set[str] = set()
        self._finished_seen: set[str] = set()  # ids the scheduler finished (get_finished's)
        self._errors: dict[str, TransferError] = {}
        self._load_error_blocks: set[int] = set()

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, np.ndarray]) -> None:
        """Describes vLLM's per-layer paged caches to the agent (one PAGED group, slot = block)
        and starts it. The arrays must stay alive and unmoved until :meth:`shutdown`."""
        if self.agent is not None:
            raise RuntimeError("register_kv_caches was already called")
        if not kv_caches:
            raise ValueError("no KV caches")
        layout = self.config.get("kv_layout", "NHD").upper()
        shape_kind = self.config.get("kv_shape", "kv_first")
        if layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be NHD or HND, not {layout!r}")
        if shape_kind not in ("kv_first", "blocks_first"):
            raise ValueError(f"kv_shape must be kv_first or blocks_first, not {shape_kind!r}")
        layers = sorted(kv_caches.items(), key=lambda item: layer_index(item[0]))
        first = layers[0][1]
        for name, cache in layers:
            if cache.shape != first.shape or cache.dtype != first.dtype:
                raise ValueError(
                    f"{name}: {cache.shape} {cache.dtype}, not {first.shape} {first.dtype}"
                )
            if not cache.flags.c_contiguous:
                raise ValueError(f"{name}: the KV cache is not C-contiguous")
        if len(first.shape) != 5:
            raise ValueError(f"a KV cache has 5 dimensions, not {first.shape}")
        if shape_kind == "kv_first":
            two, num_blocks, *inner = first.shape
        else:
            num_blocks, two, *inner = first.shape
        if two != 2:
            raise ValueError(f"{shape_kind} cache shape {first.shape} has no K/V dimension of 2")
        if layout == "NHD":
            block_size, num_heads, head_size = inner
        else:
            num_heads, block_size, head_size = inner
        self.block_size = block_size
        dtype = self.config.get("dtype") or _DTYPES.get(first.dtype)
        if dtype is None:
            raise ValueError(f"no kvferry dtype for {first.dtype}; set config['dtype']")
        elem = first.dtype.itemsize
        buffer = block_size * num_heads * head_size * elem  # one block of K (or V)
        tp_size, tp_rank = int(self.config.get("tp_size", 1)), int(self.config.get("tp_rank", 0))
        role_layout = {
            "kind": layout.lower(),
            "dtype": dtype,
            "elem_bits": elem * 8,
            "num_shards": tp_size,
            "shard_index": tp_rank,
            # HND: one head's [token][dim] of a block; NHD: one head of one token.
            "shard_unit_bytes": (block_size if layout == "HND" else 1) * head_size * elem,
        }
        pools, views = [], []
        for local, (_, cache) in enumerate(layers):
            if shape_kind == "kv_first":
                for kv, role in enumerate(("key", "value")):
                    views.append({
                        "pool": len(pools),
                        "roles": [role],
                        "entries": [{"local_layer": local, "offset": 0, "size": buffer}],
                        "layout": role_layout,
                    })
                    pools.append({
                        "base": cache.ctypes.data + kv * cache.strides[0],
                        "slot_bytes": buffer,
                        "num_slots": num_blocks,
                        "memory_type": "dram",
                    })
            else:
                views.append({
                    "pool": len(pools),
                    "roles": ["key", "value"],
                    "entries": [
                        {"local_layer": local, "offset": kv * buffer, "size": buffer}
                        for kv in range(2)
                    ],
                    "layout": role_layout,
                })
                pools.append({
                    "base": cache.ctypes.data,
                    "slot_bytes": 2 * buffer,
                    "num_slots": num_blocks,
                    "memory_type": "dram",
                })
        agent_config = {
            "version": kvferry.CONFIG_VERSION,
            "instance": self.instance,
            "role": "context" if self.role == PRODUCER else "generation",
            "label": f"vllm {len(layers)} layers x {num_heads} kv heads x {head_size} {layout}",
            "architecture": self.config.get("architecture", "LlamaForCausalLM"),
            "planner": self.config.get("planner", "kvferry.default"),
            "plugin_dir": self.config["plugin_dir"],
            "transport": self.config.get("transport", "tcp"),
            "listen": self.config.get("listen", "0.0.0.0:0"),
            "secret": self.config["secret"],
            "rank": {
                "mapping": f"tp{tp_size}",
                "instance_rank": tp_rank,
                "layers_per_pp": [len(layers)],
                "page_table": {
                    "tokens_per_block": block_size,
                    "pools": pools,
                    "groups": [{
                        "kind": "paged",
                        "layers": [
                            {"local": local, "global": layer_index(name)}
                            for local, (name, _) in enumerate(layers)
                        ],
                        "views": views,
                    }],
                },
            },
        }
        for key in ("advertise", "timeout_ms", "lease_ms"):
            if key in self.config:
                agent_config[key] = self.config[key]
        agent_config.update(self.config.get("agent", {}))
        self.agent = kvferry.Agent(json.dumps(agent_config), keep_alive=[c for _, c in layers])
        logger.info(
            "kvferry %s agent %s started over %d pools", self.role, self.instance, len(pools)
        )

    def bind_connector_metadata(self, connector_metadata: KVFerryConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        """Starts this step's transfers: ``expect`` for every request to load (consumer),
        ``send`` for every finished prefill (producer). Returns at once; the bytes move on the
        agent's threads and :meth:`get_finished` reports them."""
        meta = kwargs.get("metadata") or self._connector_metadata
        if meta is None:
            return
        agent = self._require_agent()
        for req in meta.reqs_to_recv.values():
            table = np.asarray(req.block_ids[: self._blocks(req.prompt_len)], dtype=np.int32)
            try:
                agent.expect(
                    req.transfer_id,
                    req.remote_instance,
                    req.remote_endpoints,
                    req.remote_dp_rank,
                    req.prompt_len,
                    [table],
                    cached_prefix=req.cached_tokens or None,
                )
            except kvferry.Error as e:
                self._fail(req, "refused", e.kind, str(e))
                self._done_recving.add(req.request_id)
                continue
            self._in_flight[req.transfer_id] = req
        for req in meta.reqs_to_send.values():
            table = np.asarray(req.block_ids[: self._blocks(req.prompt_len)], dtype=np.int32)
            try:
                agent.send(req.transfer_id, [table], 0, req.prompt_len, req.prompt_len, True)
            except kvferry.Error as e:
                self._fail(req, "refused", e.kind, str(e))
                self._done_sending[req.request_id] = req
                continue
            self._in_flight[req.transfer_id] = req

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: loads are asynchronous (the scheduler runs a request only after
        :meth:`get_finished` reported it in ``finished_recving``)."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing to do: kvferry reads the paged cache in place when the request is sent."""

    def wait_for_save(self) -> None:
        """Nothing to wait for: a send's blocks stay the connector's until ``finished_sending``
        (``request_finished`` delayed their free)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Drains the agent's events: ``(finished_sending, finished_recving)``. A producer's
        request is reported only once the scheduler has finished it (it is, or was, in
        ``finished_req_ids``), as vLLM requires. Failures are reported as finished too; see
        :meth:`take_transfer_errors`."""
        self._finished_seen |= set(finished_req_ids)
        if self.agent is not None:
            for event in self.agent.poll():
                req = self._in_flight.pop(event.request, None)
                if req is None:
                    logger.warning(
                        "kvferry: event for a request this connector does not hold: %r", event
                    )
                    continue
                if event.kind not in ("sent", "received"):
                    self._fail(req, event.kind, event.failure_kind, event.detail or event.kind)
                if self.role == PRODUCER:
                    self._done_sending[req.request_id] = req
                else:
                    self._done_recving.add(req.request_id)
        sending = {r for r in self._done_sending if r in self._finished_seen}
        for r in sending:
            del self._done_sending[r]
        # Only ids of requests still ours are worth remembering.
        self._finished_seen &= (
            set(self._done_sending)
            | set(self._reqs_need_send)
            | {req.request_id for req in self._in_flight.values()}
        )
        recving, self._done_recving = self._done_recving, set()
        return (sending or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of failed loads since the last call (vLLM recomputes them)."""
        blocks, self._load_error_blocks = self._load_error_blocks, set()
        return blocks

    def take_transfer_errors(self) -> dict[str, TransferError]:
        """The failed transfers since the last call, by request id (each was also reported
        finished by :meth:`get_finished`)."""
        errors, self._errors = self._errors, {}
        return errors

    def shutdown(self) -> None:
        """Closes the agent (it lets go of the caches before this returns)."""
        if self.agent is not None:
            self.agent.close()

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Consumer: the remote prompt tokens beyond ``num_computed_tokens``, loaded
        asynchronously. Side-effect free."""
        params = request.kv_transfer_params or {}
        if self.role == CONSUMER and params.get("do_remote_prefill"):
            count = int(params["prompt_len"]) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Consumer: records the blocks allocated for the remote tokens (the whole prompt's,
        the locally cached prefix included) for the next step's metadata."""
        params = request.kv_transfer_params or {}
        if self.role != CONSUMER or not params.get("do_remote_prefill") or num_external_tokens == 0:
            return
        prompt_len = int(params["prompt_len"])
        cached = prompt_len - num_external_tokens
        block_ids = _block_ids(blocks)
        if cached % self.block_size or len(block_ids) < self._blocks(prompt_len):
            raise ValueError(
                f"{request.request_id}: {len(block_ids)} blocks and {cached} cached tokens for a "
                f"{prompt_len}-token prompt in blocks of {self.block_size}"
            )
        self._reqs_need_recv[request.request_id] = ReqMeta(
            request_id=request.request_id,
            transfer_id=int(params["kvferry_request"]),
            block_ids=block_ids,
            prompt_len=prompt_len,
            cached_tokens=cached,
            remote_instance=params["remote_instance"],
            remote_endpoints=list(params["remote_endpoints"]),
            remote_dp_rank=int(params.get("remote_dp_rank", 0)),
        )
        # Loaded once: a second call for this request (after the load) adds nothing.
        params["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output: Any = None) -> KVFerryConnectorMetadata:
        """This step's metadata for the worker; resets the scheduler side's pending state."""
        meta = KVFerryConnectorMetadata(self._reqs_need_recv, self._reqs_need_send)
        self._reqs_need_recv, self._reqs_need_send = {}, {}
        return meta

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Producer: a prefill asked for remote decode (``do_remote_decode``) keeps its blocks
        (``delay_free=True``) until ``finished_sending``, and answers the ``kv_transfer_params``
        the decode instance's request carries."""
        params = request.kv_transfer_params or {}
        if self.role != PRODUCER or not params.get("do_remote_decode"):
            return False, None
        prompt_len = _prompt_len(request)
        block_ids = _block_ids(block_ids)
        if prompt_len == 0 or len(block_ids) < self._blocks(prompt_len):
            logger.warning("kvferry: %s has %d blocks for %d tokens; not sent",
                           request.request_id, len(block_ids), prompt_len)
            return False, None
        transfer_id = kvferry_request_id(self.instance, request.request_id)
        self._reqs_need_send[request.request_id] = ReqMeta(
            request_id=request.request_id,
            transfer_id=transfer_id,
            block_ids=block_ids,
            prompt_len=prompt_len,
        )
        endpoints = self.config.get("endpoints") or [self._require_agent().endpoint()]
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_instance": self.instance,
            "remote_endpoints": endpoints,
            "remote_dp_rank": int(self.config.get("dp_rank", 0)),
            "remote_request_id": request.request_id,
            "kvferry_request": transfer_id,
            "prompt_len": prompt_len,
        }

    # ------------------------------------------------------------------ helpers

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _require_agent(self) -> kvferry.Agent:
        if self.agent is None:
            raise RuntimeError("register_kv_caches has not been called")
        return self.agent

    def _fail(self, req: ReqMeta, kind: str, failure_kind: str | None, detail: str) -> None:
        logger.error("kvferry %s: request %s failed (%s, %s): %s",
                     self.role, req.request_id, kind, failure_kind, detail)
        self._errors[req.request_id] = TransferError(req.request_id, kind, failure_kind, detail)
        if self.role == CONSUMER:
            first = req.cached_tokens // self.block_size
            self._load_error_blocks.update(req.block_ids[first : self._blocks(req.prompt_len)])
