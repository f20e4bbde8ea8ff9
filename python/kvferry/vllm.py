"""kvferry as a vLLM KV connector: disaggregated prefill with vLLM's own request flow.

Load it by module path (vLLM installed beside kvferry)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvferryConnector",
        "kv_connector_module_path": "kvferry.vllm", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"secret_file": "/etc/kvferry/secret"}}'

and the same with ``"kv_role": "kv_consumer"`` on the decode instance (``kv_both``: either,
per request). The flow is vLLM's disaggregated prefill, as its NIXL connector has it, so
vLLM's proxies and clients work unchanged:

1. The prefill instance gets the request with ``kv_transfer_params={"do_remote_decode":
   true}`` (and ``max_tokens=1``). In the step that computes the rest of its prompt, each
   layer's blocks are handed to the workers' agents as the layer is computed
   (:meth:`KvferryConnector.save_kv_layer`: layer-wise sends, which leave while later layers
   compute; a prompt that takes several steps is sent whole when it finishes instead). When
   it finishes, :meth:`KvferryConnector.request_finished` keeps its blocks (``delay_free``),
   and the request's output carries the ``kv_transfer_params`` for the decode: this
   instance's name, its ranks' side-channel endpoints, kvferry's id of the transfer, the
   prompt's length and a digest of its tokens, and its block size.
2. The decode instance gets the request with those ``kv_transfer_params``. The scheduler
   reports the prompt's tokens beyond its own prefix-cache hits as loadable asynchronously;
   once vLLM allocated their blocks, every worker's agent ``expect``\\ s them (the planner maps
   the prefill's ranks, layout and head shards onto this worker's); the prefill ranks write
   them with UCX; the request runs once every worker reported it received. A prompt whose
   tokens differ from the prefill's (digest), or whose prefill ran with another block size,
   is prefilled locally instead.
3. The prefill instance frees the blocks once kvferry no longer reads them (``sent``, or the
   send failed, was cancelled, or its lease ran out unclaimed).

Failures: a load that fails (peer gone, refused, timed out) is reported in
``failed_recving``; vLLM then recomputes the prompt or fails the request, as its
``kv_load_failure_policy`` says. A decode request aborted while loading is cancelled and its
blocks freed only after kvferry's terminal event (nothing lands after that).

``kv_connector_extra_config`` (unknown keys are refused at start):

==================  ====================================================================
``plugin_dir``      where planner ``.so`` files are (default ``KVFERRY_PLUGIN_DIR``, else
                    the planners inside the package, ``kvferry.PLUGIN_DIR``)
``secret``,         the deployment's shared secret (text, hex, or a file holding it);
``secret_hex``,     default ``KVFERRY_SECRET``. At least 16 bytes, the same on every
``secret_file``     instance of a deployment.
``instance``        this instance's name (default: vLLM's ``engine_id``)
``planner``         planner id (default ``KVFERRY_PLANNER``, else ``kvferry.default``)
``architecture``    the architecture the planner is bound for (default: the model's)
``transport``       ``tcp`` (default), ``shm``, ``auto`` or a ``UCX_TLS`` list
``net_devices``,    passed to the agent (``host/capi/README.md``, "The configuration")
``listen``,
``advertise``,
``timeout_ms``,
``lease_ms``,
``peer_timeout_ms``,
``handshake_timeout_ms``,
``integrity``,
``ucx_peer_errors``
``cpus``            where kvferry's threads run: ``"all"`` (default: every CPU the process's
                    cgroup allows, not the core vLLM bound the worker's thread to),
                    ``"inherit"`` (the worker's binding) or a list of CPU ids
``agent``           more agent configuration fields, verbatim
``layer_wise``      send each layer as it is computed (default ``true``); ``false``: every
                    request whole when its prefill ends
==================  ====================================================================

Supported: one KV cache group of full attention (Llama, Qwen, Mistral and the like), host
memory, in vLLM's CPU backend's layout (``LBHNC``: a block holds, head after head, the head's
K stored ``[dim][token]`` and then its V ``[token][dim]``; kvferry moves whole heads' blocks)
or ``LBNHC`` (described, but untested: the CPU backend uses ``LBHNC``); TP on both sides,
different TP sizes included; pipeline parallelism on either side (each PP stage's workers
describe their own layers as ranks ``pp_rank * tp_size + tp_rank`` of ``tpXppY`` and send or
load only those; a prefill's ``remote_endpoints`` list all its workers in that order);
layer-wise sends; decode requests queued longer than the prefill's ``lease_ms`` keep their
data (the decode holds them every third of ``lease_ms``, its own setting, so both instances
should agree on it; up to ten leases). Both instances need the same ``block_size``: kvferry
re-blocks only heads whose tokens are contiguous, which the CPU backend's K is not, so a
decode instance given the KV of a prefill with other blocks (``kv_transfer_params`` say
their size) logs why, once per prefill instance, and prefills those prompts itself. Not yet:
hybrid models (several KV cache groups), CUDA tensors.

Metrics (vLLM's ``/metrics``, from the agents' terminal events): ``vllm:kvferry_transfers_total``
(``side``: ``send`` or ``load``; ``outcome``: ``sent``, ``received``, ``cancelled``,
``failed:KIND``, ``refused:KIND``), ``vllm:kvferry_bytes_total`` (``side``) and
``vllm:kvferry_load_seconds`` (a decode worker's ``expect`` to the last piece). The
connector's stats in vLLM's log also give ``send_tail_ms_avg`` (from the last bytes handed to
the agent to ``sent``) and ``layer_parts``; the gauges ``vllm:kvferry_in_flight`` and
``vllm:kvferry_peers`` (``side``) come from the agents' own ``Agent.stats()``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from . import CONFIG_VERSION, PLUGIN_DIR, Agent, Error, describe_paged_cache

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = [
    "KvferryConnector",
    "KvferryConnectorMetadata",
    "KvferryHandshake",
    "KvferryPromMetrics",
    "KvferryStats",
]

# Under vLLM's logger, so its handlers and level apply.
logger = logging.getLogger("vllm.kvferry")

#: kv_connector_extra_config keys taken as they are into the agent's configuration.
_AGENT_KEYS = (
    "planner",
    "transport",
    "net_devices",
    "listen",
    "advertise",
    "timeout_ms",
    "lease_ms",
    "peer_timeout_ms",
    "handshake_timeout_ms",
    "integrity",
    "ucx_peer_errors",
)
_KEYS = frozenset(
    _AGENT_KEYS
    + ("plugin_dir", "secret", "secret_hex", "secret_file", "instance", "architecture", "cpus")
    + ("agent", "layer_wise")
)
#: The block interiors this connector describes: vLLM's layout name -> kvferry's layout kind.
_LAYOUTS = {"LBHNC": "hnd", "BLHNC": "hnd", "LBNHC": "nhd", "BLNHC": "nhd"}


def transfer_id(instance: str, request_id: str) -> int:
    """kvferry's id of a request (63 bits of a hash of the prefill instance's name and vLLM's
    request id); the decode side reads it from ``kv_transfer_params``."""
    digest = hashlib.blake2b(f"{instance}/{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def prompt_digest(token_ids: Any) -> str:
    """A digest of a prompt's token ids: the decode instance loads the prefill's KV only for
    the same tokens."""
    data = b"".join(int(t).to_bytes(4, "little", signed=True) for t in token_ids)
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def layer_index(name: str) -> int:
    """The layer index in a vLLM layer name (``model.layers.3.self_attn.attn`` -> 3)."""
    numbers = [int(part) for part in name.split(".") if re.fullmatch(r"\d+", part)]
    if len(numbers) != 1:
        raise ValueError(f"kvferry: layer name {name!r} has {len(numbers)} integer parts, not one")
    return numbers[0]


@contextlib.contextmanager
def _threads_on(cpus: set[int] | None):
    """Runs the block with the calling thread allowed on ``cpus``, so the threads the agent
    starts there inherit that mask instead of the worker's: vLLM's CPU workers bind their
    thread to the cores its kernels use (``VLLM_CPU_OMP_THREADS_BIND``), and kvferry's side
    channel and UCX progress threads pinned to a core a busy engine loop spins on answered a
    handshake in a minute instead of milliseconds (measured with two ``vllm serve`` instances
    on this 2-core machine)."""
    if cpus is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:
        logger.warning("kvferry: cannot run its threads on CPUs %s: %s", sorted(cpus), e)
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _cpu_list(value: Any) -> set[int] | None:
    """``cpus``: ``"inherit"``, ``"all"`` or a list of CPU ids."""
    if value == "inherit":
        return None
    if value == "all":
        allowed = _cgroup_cpus()
        return allowed or set(range(os.cpu_count() or 1))
    if isinstance(value, list) and value and all(isinstance(c, int) and c >= 0 for c in value):
        return set(value)
    raise ValueError(f'kvferry: cpus must be "all", "inherit" or a list of CPU ids, not {value!r}')


def _cgroup_cpus() -> set[int]:
    """The CPUs this process's cgroup allows (cgroup v2), or nothing if that is not known."""
    try:
        with open("/sys/fs/cgroup/cpuset.cpus.effective", encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return set()
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


class _Settings:
    """``kv_connector_extra_config``, checked."""

    def __init__(self, vllm_config: VllmConfig):
        transfer = vllm_config.kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config or {})
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise ValueError(
                f"kvferry: unknown kv_connector_extra_config key {unknown[0]!r} "
                f"(known: {', '.join(sorted(_KEYS))})"
            )
        self.extra = extra
        self.role = transfer.kv_role
        if self.role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError(
                f"kvferry: kv_role must be kv_producer, kv_consumer or kv_both, not {self.role!r}"
            )
        parallel = vllm_config.parallel_config
        self.tp_size = parallel.tensor_parallel_size
        self.pp_size = parallel.pipeline_parallel_size
        instance = extra.get("instance", transfer.engine_id)
        if not isinstance(instance, str) or not instance:
            raise ValueError(f"kvferry: instance must be a non-empty string, not {instance!r}")
        if parallel.data_parallel_size > 1:
            instance = f"{instance}-dp{parallel.data_parallel_rank}"
        self.instance = instance
        self.plugin_dir = (
            extra.get("plugin_dir")
            or os.environ.get("KVFERRY_PLUGIN_DIR")
            or (PLUGIN_DIR if os.path.isdir(PLUGIN_DIR) else None)
        )
        if not self.plugin_dir:
            raise ValueError(
                "kvferry: no planner directory: this kvferry package carries none (built in "
                "place?); set kv_connector_extra_config plugin_dir or KVFERRY_PLUGIN_DIR"
            )
        self.secret = self._secret(extra)
        architectures = getattr(vllm_config.model_config.hf_config, "architectures", None) or []
        self.architecture = extra.get("architecture") or (architectures[0] if architectures else "")
        if not self.architecture:
            raise ValueError(
                "kvferry: the model's config names no architecture; set "
                "kv_connector_extra_config architecture"
            )
        self.cpus = _cpu_list(extra.get("cpus", "all"))
        self.layer_wise = extra.get("layer_wise", True)
        if not isinstance(self.layer_wise, bool):
            raise ValueError(f"kvferry: layer_wise must be true or false, not {self.layer_wise!r}")
        agent = extra.get("agent", {})
        if not isinstance(agent, dict):
            raise ValueError(f"kvferry: agent must be an object, not {agent!r}")
        self.agent = agent

    @staticmethod
    def _secret(extra: dict[str, Any]) -> dict[str, str]:
        given = [k for k in ("secret", "secret_hex", "secret_file") if k in extra]
        if len(given) > 1:
            raise ValueError(f"kvferry: give one of {' and '.join(given)}, not both")
        if not given:
            env = os.environ.get("KVFERRY_SECRET")
            if not env:
                raise ValueError(
                    "kvferry: no secret: set kv_connector_extra_config secret, secret_hex or "
                    "secret_file, or KVFERRY_SECRET"
                )
            return {"secret": env}
        key = given[0]
        if key == "secret_file":
            path = extra[key]
            try:
                with open(path, encoding="utf-8") as f:
                    return {"secret": f.read().strip()}
            except OSError as e:
                raise ValueError(f"kvferry: secret_file {path!r}: {e.strerror}") from e
        return {key: str(extra[key])}

    @property
    def mapping(self) -> str:
        """The instance's deployment in kvferry's shorthand (``tp2``, ``tp1pp2``)."""
        return f"tp{self.tp_size}" + (f"pp{self.pp_size}" if self.pp_size > 1 else "")

    def instance_rank(self, pp_rank: int, tp_rank: int) -> int:
        """kvferry's number of the worker at (``pp_rank``, ``tp_rank``): TP fastest, then PP
        (``pp_rank * tp_size + tp_rank``, as kvferry's ``Mapping::coords`` and vLLM's own
        ranks of one instance count)."""
        return pp_rank * self.tp_size + tp_rank

    @property
    def sends(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def receives(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")


@dataclass
class KvferryHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells its scheduler at start: its prefill agent's side-channel endpoint,
    and where the worker sits (its TP and PP rank)."""

    tp_rank: int
    endpoint: str | None
    pp_rank: int = 0


@dataclass
class _Recv:
    request_id: str
    transfer_id: int
    block_ids: list[int]
    prompt_len: int
    cached_tokens: int
    remote_instance: str
    remote_endpoints: list[str]
    remote_dp_rank: int


@dataclass
class _Send:
    request_id: str
    transfer_id: int
    block_ids: list[int]
    prompt_len: int
    #: Sent layer by layer from ``save_kv_layer`` during this step's forward pass (its prompt
    #: ends in this step), else at once.
    layer_wise: bool = False


@dataclass
class KvferryConnectorMetadata(KVConnectorMetadata):
    """One step's orders from the scheduler to every worker."""

    recv: list[_Recv] = field(default_factory=list)
    send: list[_Send] = field(default_factory=list)
    #: Decode requests aborted while loading: cancel them.
    cancel: list[str] = field(default_factory=list)
    #: Prefill requests sent layer-wise that ended without handing over (aborted, stopped
    #: early): cancel their sends.
    cancel_send: list[str] = field(default_factory=list)
    #: Decode requests still queued: (prefill instance, its endpoints, transfer ids) to hold.
    hold: list[tuple[str, list[str], list[int]]] = field(default_factory=list)


def _empty_stats() -> dict[str, Any]:
    return {
        "transfers": {},
        "bytes": {},
        "load_seconds": [],
        "send_tail_seconds": [],
        "layer_parts": 0,
        # The agents' own counters (Agent.stats) by "side/tp rank", the latest of each worker:
        # requests held, peers connected, planning time so far.
        "agents": {},
    }


@dataclass
class KvferryStats(KVConnectorStats):
    """One interval's transfers, from the agents' terminal events: ``transfers`` counts by
    ``"side/outcome"`` (side ``send`` or ``load``; outcome ``sent``, ``received``,
    ``cancelled``, ``failed:KIND`` or ``refused:KIND``), ``bytes`` by side, ``load_seconds``
    one entry per received load (from ``expect`` to the last piece), ``send_tail_seconds`` one
    entry per request sent, from the moment its last bytes were handed to the agent (its last
    layer computed, layer-wise; the send order reaching the worker, whole) to ``sent``, and
    ``layer_parts`` the layer-wise sends made."""

    def __post_init__(self) -> None:
        if not self.data:
            self.data = _empty_stats()

    def reset(self) -> None:
        self.data = _empty_stats()

    def aggregate(self, other: KVConnectorStats) -> KvferryStats:
        if other.is_empty():
            return self
        for key in ("transfers", "bytes"):
            mine = self.data[key]
            for name, value in other.data[key].items():
                mine[name] = mine.get(name, 0) + value
        for key in ("load_seconds", "send_tail_seconds"):
            self.data[key] = self.data[key] + other.data[key]
        self.data["layer_parts"] += other.data["layer_parts"]
        # Each worker's own entry; a later report of the same worker replaces its earlier one.
        self.data.setdefault("agents", {}).update(other.data.get("agents", {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        loads = self.data["load_seconds"]
        reduced: dict[str, int | float] = dict(sorted(self.data["transfers"].items()))
        for side, count in self.data["bytes"].items():
            reduced[f"{side}_MB"] = round(count / 1e6, 3)
        if loads:
            reduced["load_ms_avg"] = round(1e3 * sum(loads) / len(loads), 3)
            reduced["load_ms_max"] = round(1e3 * max(loads), 3)
        tails = self.data["send_tail_seconds"]
        if tails:
            reduced["send_tail_ms_avg"] = round(1e3 * sum(tails) / len(tails), 3)
        if self.data["layer_parts"]:
            reduced["layer_parts"] = self.data["layer_parts"]
        for side, agent in sorted(_agents_by_side(self.data).items()):
            reduced[f"{side}_in_flight"] = agent["in_flight"]
            reduced[f"{side}_peers"] = agent["peers"]
        return reduced

    def is_empty(self) -> bool:
        return not self.data["transfers"] and not self.data["layer_parts"]

    def count(self, side: str, outcome: str, nbytes: int = 0) -> None:
        transfers = self.data["transfers"]
        key = f"{side}/{outcome}"
        transfers[key] = transfers.get(key, 0) + 1
        if nbytes:
            self.data["bytes"][side] = self.data["bytes"].get(side, 0) + nbytes


def _agents_by_side(data: dict[str, Any]) -> dict[str, dict[str, int]]:
    """The workers' latest agent counters, summed by side."""
    sides: dict[str, dict[str, int]] = {}
    for key, agent in data.get("agents", {}).items():
        side = sides.setdefault(key.partition("/")[0], {"in_flight": 0, "peers": 0})
        side["in_flight"] += agent.get("in_flight", 0)
        side["peers"] += agent.get("peers", 0)
    return sides


class KvferryPromMetrics(KVConnectorPromMetrics):
    """kvferry's Prometheus metrics in vLLM's registry: ``vllm:kvferry_transfers_total``
    (``side``, ``outcome``), ``vllm:kvferry_bytes_total`` (``side``),
    ``vllm:kvferry_layer_parts_total``, the gauges ``vllm:kvferry_in_flight`` and
    ``vllm:kvferry_peers`` (``side``; from the agents' own stats) and the histograms
    ``vllm:kvferry_load_seconds`` and ``vllm:kvferry_send_tail_seconds``."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._transfers = self._counter_cls(
            name="vllm:kvferry_transfers",
            documentation="kvferry transfers ended, by side (send, load) and outcome",
            labelnames=[*labelnames, "side", "outcome"],
        )
        self._bytes = self._counter_cls(
            name="vllm:kvferry_bytes",
            documentation="KV cache bytes kvferry moved, by side (send, load)",
            labelnames=[*labelnames, "side"],
        )
        self._load_seconds = self._histogram_cls(
            name="vllm:kvferry_load_seconds",
            documentation="Time from a decode worker's expect to the last piece landing",
            buckets=[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0],
            labelnames=labelnames,
        )
        self._latest: dict[int, dict[str, dict[str, int]]] = {}
        self._in_flight = self._gauge_cls(
            name="vllm:kvferry_in_flight",
            documentation="Requests kvferry's agents hold, by side (send, load): each "
            "worker's latest report, summed",
            labelnames=[*labelnames, "side"],
            multiprocess_mode="mostrecent",
        )
        self._peers = self._gauge_cls(
            name="vllm:kvferry_peers",
            documentation="Peer connections kvferry's agents hold, by side (send, load): "
            "each worker's latest report, summed",
            labelnames=[*labelnames, "side"],
            multiprocess_mode="mostrecent",
        )
        self._layer_parts = self._counter_cls(
            name="vllm:kvferry_layer_parts",
            documentation="Layer-wise sends made (one per layer a prefill step handed over)",
            labelnames=labelnames,
        )
        self._send_tail_seconds = self._histogram_cls(
            name="vllm:kvferry_send_tail_seconds",
            documentation="Time from a request's last bytes handed to kvferry to its send "
            "ending (layer-wise: after its last layer was computed)",
            buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0],
            labelnames=labelnames,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for key, count in transfer_stats_data.get("transfers", {}).items():
            side, _, outcome = key.partition("/")
            self._transfers.labels(*labels, side, outcome).inc(count)
        for side, count in transfer_stats_data.get("bytes", {}).items():
            self._bytes.labels(*labels, side).inc(count)
        histogram = self._load_seconds.labels(*labels)
        for seconds in transfer_stats_data.get("load_seconds", []):
            histogram.observe(seconds)
        tails = self._send_tail_seconds.labels(*labels)
        for seconds in transfer_stats_data.get("send_tail_seconds", []):
            tails.observe(seconds)
        parts = transfer_stats_data.get("layer_parts", 0)
        if parts:
            self._layer_parts.labels(*labels).inc(parts)
        # Each worker's latest report, kept across intervals: an interval may bring only some
        # workers' (those that ended a transfer in it).
        latest = self._latest.setdefault(engine_idx, {})
        latest.update(transfer_stats_data.get("agents", {}))
        for side, agent in _agents_by_side({"agents": latest}).items():
            self._in_flight.labels(*labels, side).set(agent["in_flight"])
            self._peers.labels(*labels, side).set(agent["peers"])


class KvferryConnector(KVConnectorBase_V1):
    """The connector vLLM makes twice: in the engine core (``SCHEDULER``) and in every worker
    (``WORKER``). See the module's documentation."""

    #: Loaded tokens came from another vLLM instance (``vllm:prompt_tokens_cached_by_source``).
    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        self._settings = _Settings(vllm_config)
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError(
                f"kvferry: {len(kv_cache_config.kv_cache_groups)} KV cache groups (a hybrid "
                "model); the vLLM connector handles one group of full attention"
            )
        self._block_size = vllm_config.cache_config.block_size
        # Scheduler side.
        self._endpoints: list[str] = []
        self._pending_recv: dict[str, _Recv] = {}
        self._pending_send: dict[str, _Send] = {}
        self._pending_cancel: list[str] = []
        self._pending_cancel_send: list[str] = []
        self._loading: set[str] = set()  # handed to the workers, not finished yet
        self._may_send_layer_wise: dict[str, int] = {}  # request id -> prompt length
        self._sent_layer_wise: set[str] = set()
        # Prefill instances whose block size this one refused, logged once: (instance, size).
        self._block_size_refused: set[tuple[str, int]] = set()
        # Decode requests queued before their load: request id -> (instance, endpoints, id).
        self._queued: dict[str, tuple[str, tuple[str, ...], int]] = {}
        self._next_hold = 0.0
        lease_ms = self._settings.extra.get("lease_ms", 60_000)
        self._hold_every = max(float(lease_ms) / 3e3, 0.05)
        # Worker side.
        self._sender: Agent | None = None
        self._receiver: Agent | None = None
        self._tp_rank = 0
        self._pp_rank = 0
        self._rank = 0  # kvferry's instance rank of this worker
        self._in_flight: dict[int, tuple[str, str]] = {}  # transfer id -> (request id, role)
        self._recv_ids: dict[str, int] = {}  # request id -> transfer id, loading
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._finished_seen: set[str] = set()
        self._stats = KvferryStats()
        self._layer_of: dict[str, int] = {}  # layer name -> its view in the page table
        self._layer_sends: dict[int, tuple[_Send, set[int]]] = {}  # this step's, views sent
        self._handed: dict[int, float] = {}  # transfer id -> when its last send was made
        self._layer_orders_taken = False  # this step's layer-wise orders are in _layer_sends

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Describes vLLM's paged caches to kvferry (one pool per layer, slot = block, in
        place: nothing is copied) and starts this worker's agents."""
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        self._tp_rank = get_tensor_model_parallel_rank()
        self._pp_rank = get_pp_group().rank_in_group if self._settings.pp_size > 1 else 0
        self._rank = self._settings.instance_rank(self._pp_rank, self._tp_rank)
        rank = self._describe(kv_caches)
        base = {
            "version": CONFIG_VERSION,
            "instance": self._settings.instance,
            "architecture": self._settings.architecture,
            "plugin_dir": self._settings.plugin_dir,
            "rank": rank,
            "label": f"vllm {self._settings.instance} {self._who()}",
            **self._settings.secret,
        }
        for key in _AGENT_KEYS:
            if key in self._settings.extra:
                base[key] = self._settings.extra[key]
        base.update(self._settings.agent)
        keep = list(kv_caches.values())
        with _threads_on(self._settings.cpus):
            if self._settings.sends:
                self._sender = Agent(json.dumps({**base, "role": "context"}), keep_alive=keep)
            if self._settings.receives:
                self._receiver = Agent(
                    json.dumps({**base, "role": "generation"}), keep_alive=keep
                )
        logger.info(
            "kvferry: %s %s: %s over %d layers%s",
            self._settings.instance,
            self._who(),
            self._settings.role,
            len(kv_caches),
            f", listening on {self._sender.endpoint()}" if self._sender else "",
        )

    def _who(self) -> str:
        """This worker, for logs and the agent's label."""
        if self._settings.pp_size == 1:
            return f"tp rank {self._tp_rank}"
        return f"rank {self._rank} (tp rank {self._tp_rank}, pp rank {self._pp_rank})"

    def _layers_per_pp(self, layers: list[int]) -> list[int]:
        """The layers vLLM gives each PP stage (its ``get_pp_indices``, which
        ``VLLM_PP_LAYER_PARTITION`` may set), checked against the layers this worker
        registered: every one must be in its own stage."""
        from vllm.distributed.utils import get_pp_indices

        model = self._vllm_config.model_config
        total = model.get_total_num_hidden_layers()
        pp = self._settings.pp_size
        ranges = [get_pp_indices(total, r, pp) for r in range(pp)]
        start, end = ranges[self._pp_rank]
        outside = [layer for layer in layers if not start <= layer < end]
        if outside:
            raise ValueError(
                f"kvferry: {self._who()} registered KV caches of layers {outside}, outside its "
                f"PP stage {self._pp_rank} of {pp} (layers {start}..{end - 1} of {total})"
            )
        return [e - s for s, e in ranges]

    def _describe(self, kv_caches: dict[str, torch.Tensor]) -> dict[str, Any]:
        """This worker's rank description (kvferry.describe_paged_cache): one pool per layer,
        the layer group and its views, sharded as vLLM shards the KV heads; under PP, rank
        ``pp_rank * tp_size + tp_rank`` of ``tpXppY``, holding its stage's layers."""
        config = self._kv_cache_config
        spec = config.kv_cache_groups[0].kv_cache_spec
        layout = str(getattr(config, "kv_cache_layout", "LBHNC"))
        kind = _LAYOUTS.get(layout)
        if kind is None:
            raise ValueError(
                f"kvferry: KV cache layout {layout} is not supported (a block's heads must be "
                f"contiguous: {', '.join(_LAYOUTS)})"
            )
        layers = sorted(kv_caches.items(), key=lambda item: layer_index(item[0]))
        first = layers[0][1]
        if first.device.type != "cpu":
            raise ValueError(
                f"kvferry: KV caches on {first.device}; the vLLM connector takes host memory "
                "for now"
            )
        # vLLM's view is [block, head, token, K|V] whatever the layout; NHD keeps the token
        # dimension outside the head's, so its [block, token, head, K|V] view is contiguous.
        # (The CPU backend's bytes in a head's block are K as [dim][token], then V as
        # [token][dim]: whole heads move right, whatever their interior; re-blocking would
        # not, and get_num_new_matched_tokens refuses another block size.)
        tensors = [cache if kind == "hnd" else cache.transpose(1, 2) for _, cache in layers]
        self._layer_of = {name: local for local, (name, _) in enumerate(layers)}
        layers_per_pp = self._layers_per_pp([layer_index(name) for name, _ in layers])
        try:
            return describe_paged_cache(
                tensors,
                block_size=spec.block_size,
                num_kv_heads=spec.num_kv_heads,
                head_size=spec.head_size,
                value_head_size=getattr(spec, "head_size_v", spec.head_size),
                layout=kind,
                kv="fused",
                tp_size=self._settings.tp_size,
                tp_rank=self._tp_rank,
                total_kv_heads=self._vllm_config.model_config.get_total_num_kv_heads(),
                layers=[layer_index(name) for name, _ in layers],
                mapping=self._settings.mapping,
                instance_rank=self._rank,
                layers_per_pp=layers_per_pp,
                names=[name for name, _ in layers],
            )
        except ValueError as e:
            raise ValueError(f"kvferry: {e} (vLLM's cache, {layout})") from None

    def get_handshake_metadata(self) -> KvferryHandshake:
        return KvferryHandshake(
            tp_rank=self._tp_rank,
            endpoint=self._sender.endpoint() if self._sender is not None else None,
            pp_rank=self._pp_rank,
        )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Hands this step's requests to the agents; returns at once (the bytes move on the
        agents' threads, and :meth:`get_transfer_results` reports them)."""
        meta = self._connector_metadata
        if not isinstance(meta, KvferryConnectorMetadata):
            return
        for request_id in meta.cancel:
            tid = self._recv_ids.get(request_id)
            if tid is not None and self._receiver is not None:
                try:
                    self._receiver.cancel(tid)
                except Error as e:  # it ended already; its event reports it
                    logger.debug("kvferry: cancel %s: %s", request_id, e)
        if meta.hold and self._receiver is not None and self._rank == 0:
            for instance, endpoints, tids in meta.hold:
                try:
                    self._receiver.hold(instance, endpoints, tids)
                except Error as e:
                    logger.warning("kvferry: holding %d requests of %s: %s", len(tids), instance, e)
        for request_id in meta.cancel_send:
            tid = transfer_id(self._settings.instance, request_id)
            if tid in self._in_flight and self._sender is not None:
                try:
                    self._sender.cancel(tid)
                except Error as e:  # it ended already; its event reports it
                    logger.debug("kvferry: cancel send %s: %s", request_id, e)
        for req in meta.recv:
            self._expect(req)
        self._take_layer_orders()
        for req in meta.send:
            if not req.layer_wise:
                self._send(req)

    def _table(self, block_ids: list[int], prompt_len: int) -> list[int]:
        """The prompt's blocks (the agent takes a list of ints as a slot table)."""
        return block_ids[: -(-prompt_len // self._block_size)]

    def _expect(self, req: _Recv) -> None:
        if self._receiver is None:
            raise RuntimeError("kvferry: a load order reached a worker that does not receive")
        try:
            self._receiver.expect(
                req.transfer_id,
                req.remote_instance,
                req.remote_endpoints,
                req.remote_dp_rank,
                req.prompt_len,
                [self._table(req.block_ids, req.prompt_len)],
                cached_prefix=req.cached_tokens or None,
            )
        except Error as e:
            logger.error("kvferry: load of %s refused: %s", req.request_id, e)
            self._stats.count("load", f"refused:{e.kind}")
            self._failed_recving.add(req.request_id)
            self._done_recving.add(req.request_id)
            return
        self._in_flight[req.transfer_id] = (req.request_id, "recv")
        self._recv_ids[req.request_id] = req.transfer_id

    def _send(self, req: _Send) -> None:
        if self._sender is None:
            raise RuntimeError("kvferry: a send order reached a worker that does not send")
        table = self._table(req.block_ids, req.prompt_len)
        try:
            self._sender.send(req.transfer_id, [table], 0, req.prompt_len, req.prompt_len, True)
        except Error as e:
            logger.error("kvferry: send of %s refused: %s", req.request_id, e)
            self._stats.count("send", f"refused:{e.kind}")
            self._done_sending.add(req.request_id)
            return
        self._in_flight[req.transfer_id] = (req.request_id, "send")
        self._handed[req.transfer_id] = time.monotonic()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request runs only after its whole load was reported."""

    def _take_layer_orders(self) -> None:
        """This step's layer-wise send orders, taken once per step from the metadata vLLM
        bound before the forward pass (it may start the step's loads after the pass)."""
        if self._layer_orders_taken:
            return
        self._layer_orders_taken = True
        meta = self._connector_metadata
        if not isinstance(meta, KvferryConnectorMetadata) or self._sender is None:
            return
        for req in meta.send:
            if req.layer_wise:
                self._layer_sends[req.transfer_id] = (req, set())

    def _send_views(self, tid: int, views: list[int] | None) -> None:
        """Sends the layers ``views`` (all not sent yet: None) of this step's layer-wise
        request ``tid``; the one that sends its last layer is its last send."""
        req, sent = self._layer_sends[tid]
        todo = set(range(len(self._layer_of))) - sent if views is None else set(views) - sent
        if not todo:
            return
        table = self._table(req.block_ids, req.prompt_len)
        last = len(sent) + len(todo) == len(self._layer_of)
        try:
            self._sender.send(
                tid, [table], 0, req.prompt_len, req.prompt_len, last,
                views=[(0, v) for v in sorted(todo)],
            )
        except Error as e:
            logger.error("kvferry: layer-wise send of %s refused: %s", req.request_id, e)
            self._stats.count("send", f"refused:{e.kind}")
            del self._layer_sends[tid]
            if sent:  # its earlier layers went: end it, and its event frees the blocks
                with contextlib.suppress(Error):
                    self._sender.cancel(tid)
            else:
                self._done_sending.add(req.request_id)
            return
        if not sent:
            self._in_flight[tid] = (req.request_id, "send")
        sent |= todo
        self._stats.data["layer_parts"] += 1
        if last:
            self._handed[tid] = time.monotonic()

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Layer-wise sends: this layer of every request whose prompt this step completes is
        in the paged cache now, so it leaves while later layers compute (kvferry reads the
        cache in place; nothing is copied)."""
        view = self._layer_of.get(layer_name)
        if view is None or self._sender is None:
            return
        self._take_layer_orders()
        for tid in list(self._layer_sends):
            self._send_views(tid, [view])

    def wait_for_save(self) -> None:
        """The forward pass is over: any layer of this step's layer-wise requests that no
        ``save_kv_layer`` sent goes now. A sent request's blocks stay kvferry's until it
        reports them in ``finished_sending``."""
        self._take_layer_orders()
        for tid in list(self._layer_sends):
            self._send_views(tid, None)
        self._layer_sends.clear()
        self._layer_orders_taken = False

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        self._finished_seen |= finished_req_ids
        for agent in (self._sender, self._receiver):
            if agent is None:
                continue
            for event in agent.poll():
                owner = self._in_flight.pop(event.request, None)
                if owner is None:
                    logger.warning("kvferry: an event for no request of ours: %s", event.kind)
                    continue
                request_id, side = owner
                outcome = (
                    event.kind
                    if event.kind in ("sent", "received", "cancelled")
                    else f"failed:{event.failure_kind or event.kind}"
                )
                self._stats.count("send" if side == "send" else "load", outcome, event.bytes)
                if event.kind == "received":
                    self._stats.data["load_seconds"].append(event.latency_us / 1e6)
                handed = self._handed.pop(event.request, None)
                if event.kind == "sent" and handed is not None:
                    self._stats.data["send_tail_seconds"].append(time.monotonic() - handed)
                logger.debug(
                    "kvferry: %s %s: %s, %d bytes", side, request_id, event.kind, event.bytes
                )
                if side == "send":
                    if event.kind != "sent":
                        logger.warning(
                            "kvferry: send of %s ended %s (%s): %s",
                            request_id, event.kind, event.failure_kind, event.detail,
                        )
                    self._done_sending.add(request_id)
                else:
                    del self._recv_ids[request_id]
                    if event.kind != "received":
                        logger.error(
                            "kvferry: load of %s ended %s (%s): %s",
                            request_id, event.kind, event.failure_kind, event.detail,
                        )
                        self._failed_recving.add(request_id)
                    self._done_recving.add(request_id)
        # vLLM takes a finished send only for a request it has finished.
        sending = self._done_sending & self._finished_seen
        self._done_sending -= sending
        self._finished_seen -= sending
        self._finished_seen &= self._done_sending | {
            r for r, side in self._in_flight.values() if side == "send"
        }
        results = KVConnectorTransferResults(
            finished_sending=sending,
            finished_recving=self._done_recving,
            failed_recving=self._failed_recving,
        )
        self._done_recving, self._failed_recving = set(), set()
        return results

    def get_kv_connector_stats(self) -> KvferryStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KvferryStats()
        for side, agent in (("send", self._sender), ("load", self._receiver)):
            if agent is not None and not agent.closed:
                now = agent.stats()
                stats.data["agents"][f"{side}/{self._rank}"] = {
                    "in_flight": now["in_flight"],
                    "peers": now["peers"],
                    "plan_ns": now["plan_ns"],
                }
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvferryStats:
        return KvferryStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls, vllm_config, metric_types, labelnames, per_engine_labelvalues
    ) -> KvferryPromMetrics:
        return KvferryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def shutdown(self) -> None:
        for agent in (self._sender, self._receiver):
            if agent is not None and not agent.closed:
                agent.close()

    # ------------------------------------------------------------------ scheduler side

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        """The workers' endpoints by TP rank (PP 1)."""
        self.set_xfer_handshake_metadata_pp_aware(
            {(getattr(meta, "pp_rank", 0), tp): meta for tp, meta in metadata.items()}
        )

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """The workers' endpoints by (PP rank, TP rank), as vLLM's engine core collects them:
        kept in kvferry's rank order (``pp_rank * tp_size + tp_rank``), the order the decode
        instance gets them in ``remote_endpoints``."""
        endpoints = {
            self._settings.instance_rank(pp, tp): meta.endpoint
            for (pp, tp), meta in metadata.items()
            if isinstance(meta, KvferryHandshake) and meta.endpoint
        }
        world = self._settings.tp_size * self._settings.pp_size
        if self._settings.sends and sorted(endpoints) != list(range(world)):
            raise RuntimeError(
                f"kvferry: endpoints of ranks {sorted(endpoints)} ({self._settings.mapping}) "
                f"reached the scheduler, not all {world}"
            )
        self._endpoints = [endpoints[r] for r in sorted(endpoints)]

    def _remote(self, request: Request) -> dict[str, Any] | None:
        """The kvferry ``kv_transfer_params`` of a decode request, if it should load."""
        params = request.kv_transfer_params
        if not self._settings.receives or not params or not params.get("do_remote_prefill"):
            return None
        if "kvferry_request" not in params:
            return None  # another connector's parameters
        return params

    def on_new_request(self, request: Request) -> None:
        """A decode request that will load: held at the prefill (its lease renewed) for as long
        as it stays queued here."""
        params = self._remote(request)
        if params is None:
            return
        self._queued[request.request_id] = (
            str(params["remote_instance"]),
            tuple(str(e) for e in params["remote_endpoints"]),
            int(params["kvferry_request"]),
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        handing_over = request.kv_transfer_params or {}
        # Layer-wise only for a request that ends with its prefill step (max_tokens 1, as
        # disaggregated prefill sends them): one that decodes on here could be preempted, and
        # its blocks freed and reused while kvferry still reads them.
        if (
            self._settings.sends
            and self._settings.layer_wise
            and handing_over.get("do_remote_decode")
            and getattr(request, "max_tokens", None) == 1
        ):
            self._may_send_layer_wise[request.request_id] = len(request.prompt_token_ids or [])
        params = self._remote(request)
        if params is None:
            return 0, False
        prompt = request.prompt_token_ids or []
        if len(prompt) != params.get("prompt_len") or prompt_digest(prompt) != params.get(
            "prompt_digest"
        ):
            logger.error(
                "kvferry: %s: the prompt (%d tokens) is not the one %s prefilled (%s tokens); "
                "prefilling it here",
                request.request_id, len(prompt), params.get("remote_instance"),
                params.get("prompt_len"),
            )
            params["do_remote_prefill"] = False
            self._queued.pop(request.request_id, None)
            return 0, False
        theirs = params.get("block_size", self._block_size)
        if theirs != self._block_size:
            # vLLM's CPU cache keeps each head's K transposed ([dim][token]) before its V
            # ([token][dim]); kvferry re-blocks only heads whose tokens are contiguous, so
            # blocks of another size cannot be mapped onto these (whole heads of equal blocks
            # can, whatever their interior).
            key = (str(params.get("remote_instance")), int(theirs))
            if key not in self._block_size_refused:
                self._block_size_refused.add(key)
                logger.error(
                    "kvferry: prefill instance %s has blocks of %s tokens, this instance %d: "
                    "vLLM's CPU cache cannot be re-blocked (each head's K is stored "
                    "[dim][token]), so its prompts are prefilled here; give both instances "
                    "the same block_size",
                    key[0], theirs, self._block_size,
                )
            params["do_remote_prefill"] = False
            self._queued.pop(request.request_id, None)
            return 0, False
        count = len(prompt) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int):
        params = self._remote(request)
        if params is None or num_external_tokens == 0:
            return
        self._queued.pop(request.request_id, None)
        block_ids = list(blocks.get_block_ids()[0])
        prompt_len = len(request.prompt_token_ids)
        cached = prompt_len - num_external_tokens
        self._pending_recv[request.request_id] = _Recv(
            request_id=request.request_id,
            transfer_id=int(params["kvferry_request"]),
            block_ids=block_ids,
            prompt_len=prompt_len,
            cached_tokens=cached,
            remote_instance=str(params["remote_instance"]),
            remote_endpoints=[str(e) for e in params["remote_endpoints"]],
            remote_dp_rank=int(params.get("remote_dp_rank", 0)),
        )
        params["do_remote_prefill"] = False  # loaded once

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvferryConnectorMetadata:
        meta = KvferryConnectorMetadata(
            recv=list(self._pending_recv.values()),
            send=list(self._pending_send.values()),
            cancel=self._pending_cancel,
            cancel_send=self._pending_cancel_send,
        )
        self._loading |= set(self._pending_recv)
        self._pending_recv, self._pending_send = {}, {}
        self._pending_cancel, self._pending_cancel_send = [], []
        # Decode requests still queued keep their prefill's data: a hold every third of the
        # lease, from the first TP worker.
        now = time.monotonic()
        if self._queued and now >= self._next_hold:
            grouped: dict[tuple[str, tuple[str, ...]], list[int]] = {}
            for instance, endpoints, tid in self._queued.values():
                grouped.setdefault((instance, endpoints), []).append(tid)
            meta.hold = [(i, list(e), tids) for (i, e), tids in grouped.items()]
            self._next_hold = now + self._hold_every
        # Layer-wise sends: a prefill whose whole prompt this step computes goes layer by
        # layer during the step's forward pass. One whose prompt takes several steps
        # (chunked prefill, or preempted) is sent whole when it finishes.
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            prompt_len = self._may_send_layer_wise.pop(new.req_id, None)
            if prompt_len is None or not self._endpoints:
                continue
            blocks = list(new.block_ids[0])
            whole = new.num_computed_tokens + scheduled.get(new.req_id, 0) >= prompt_len
            if prompt_len and whole and len(blocks) * self._block_size >= prompt_len:
                tid = transfer_id(self._settings.instance, new.req_id)
                meta.send.append(_Send(new.req_id, tid, blocks, prompt_len, layer_wise=True))
                self._sent_layer_wise.add(new.req_id)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        self._loading -= set(connector_output.finished_recving or ())

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        self._queued.pop(rid, None)
        # A decode request that ends (aborted) while loading: cancel it; vLLM frees its
        # blocks once the workers report the load ended.
        if self._pending_recv.pop(rid, None) is not None:
            return False, None
        if rid in self._loading:
            self._pending_cancel.append(rid)
            return True, None
        self._may_send_layer_wise.pop(rid, None)
        params = request.kv_transfer_params
        if not self._settings.sends or not params or not params.get("do_remote_decode"):
            return False, None
        layer_wise = rid in self._sent_layer_wise
        self._sent_layer_wise.discard(rid)
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            # Aborted or stopped early: nothing to hand over. A send that went layer-wise is
            # cancelled, and its blocks wait for the agent to let them go.
            if layer_wise:
                self._pending_cancel_send.append(rid)
                return True, None
            return False, None
        prompt = request.prompt_token_ids or []
        blocks = list(block_ids[0] if isinstance(block_ids, tuple) else block_ids)
        if not prompt or len(blocks) * self._block_size < len(prompt):
            logger.warning(
                "kvferry: %s: %d blocks for a %d-token prompt; not sent",
                rid, len(blocks), len(prompt),
            )
            return False, None
        if not self._endpoints:
            raise RuntimeError("kvferry: no worker endpoints reached the scheduler")
        tid = transfer_id(self._settings.instance, rid)
        if not layer_wise:
            self._pending_send[rid] = _Send(rid, tid, blocks, len(prompt))
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_instance": self._settings.instance,
            "remote_endpoints": self._endpoints,
            "remote_dp_rank": 0,
            "remote_request_id": rid,
            "kvferry_request": tid,
            "prompt_len": len(prompt),
            "prompt_digest": prompt_digest(prompt),
            "block_size": self._block_size,
        }
