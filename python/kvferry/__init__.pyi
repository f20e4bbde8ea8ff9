"""Type stubs of kvferry (the extension module kvferry._kvferry, re-exported here)."""

from collections.abc import Sequence
from types import TracebackType
from typing import Any, Final, Literal, Protocol, final

from typing_extensions import Buffer, Self

__all__ = [
    "Agent",
    "CONFIG_VERSION",
    "Error",
    "Event",
    "PLUGIN_DIR",
    "__version__",
    "doctor",
    "flush_logs",
]

__version__: Final[str]
#: The planners shipped in this package (an agent's default plugin directory).
PLUGIN_DIR: Final[str]

def doctor() -> dict[str, Any]:
    """What this process runs: ``kvferry`` and ``planner_abi`` (versions), ``extension`` (the
    module's file), ``ucx`` (the loaded UCX's version) and ``ucx_libraries`` (its files mapped
    into the process), ``plugin_dirs`` (where an agent whose configuration names no
    ``plugin_dir`` looks), ``planners`` (``id``, ``version``, ``file`` of each that loads from
    there) and ``skipped`` (``(file, why)`` of those that do not)."""

def flush_logs(timeout: float = 1.0) -> bool:
    """Waits until every kvferry log record raised so far has reached :mod:`logging` (at most
    ``timeout`` seconds); whether they all did. Called at exit."""
#: The configuration version :class:`Agent` reads (``"version": 1``).
CONFIG_VERSION: Final[int]

#: One layer group's slots by block ordinal (``-1``: nothing here): a 1-D, C-contiguous buffer
#: of native int32 (a numpy ``int32`` array, ``array.array('i')``), or a sequence of ints.
_SlotTable = Buffer | _NumpyArray | Sequence[int]

class _NumpyArray(Protocol):
    # numpy declares ndarray's __buffer__ for Python >= 3.12 only; this lets checkers targeting
    # 3.9 to 3.11 take an ndarray too (its dtype is checked at run time).
    def __array__(self, *args: Any, **kwargs: Any) -> Any: ...

_ErrorKind = Literal[
    "config",  # the configuration is refused (bad JSON or TOML, wrong version, unknown field, ...)
    "planner",  # no planner could be bound, or it refuses this rank
    "ucx",  # no UCX context or worker
    "memory",  # the pools could not be registered
    "listen",  # the side channel could not listen or advertise
    "resources",  # a thread or descriptor could not be made
    "role",  # the call is for the other role
    "invalid",  # the request's parameters are wrong
    "duplicate",  # the request id is in use
    "unknown",  # no such request (never seen, or ended)
    "metadata",  # peer metadata that cannot be used
    "stopped",  # the agent has stopped (or was closed)
    "panic",  # an internal panic, caught
    "internal",  # anything newer
]

class Error(Exception):
    """A refused call. Nothing was taken: no event follows it."""

    kind: _ErrorKind
    #: The peer concerned, when one is.
    peer: str | None
    #: What is wrong, in words (``str(error)`` is ``"{call}: {detail}"``).
    detail: str

@final
class Event:
    """What happened to a request: exactly one terminal event per request and side. After it,
    kvferry never touches that request's slots again."""

    kind: Literal["sent", "received", "cancelled", "failed", "unknown"]
    request: int
    #: ``sent``: bytes written to all receivers; ``received``: into this rank; else 0.
    bytes: int
    #: ``received`` only (else 0): fragments, latency from ``expect`` to the last piece,
    #: writers (prefill ranks) and pieces.
    fragments: int
    latency_us: int
    writers: int
    pieces: int
    #: ``failed``: ``invalid``, ``peer``, ``refused``, ``planner``, ``timeout``, ``lease``,
    #: ``protocol``, ``write``, ``cancelled_by_peer`` or ``other``; else None.
    failure_kind: str | None
    #: ``failed``: the peer concerned (``instance rank N (epoch ...)``), if one is.
    peer: str | None
    #: ``failed``: what happened; else None.
    detail: str | None

@final
class Agent:
    """One engine rank's transfer agent, over the engine's own KV pools.

    **The engine's promise** (as with the C API's ``kvferry_agent_start``): from the
    constructor until :meth:`close` returns (or the agent is collected), every pool the
    configuration's page table names stays one live allocation at its ``base`` (numpy arrays:
    keep them referenced — pass them in ``keep_alive`` — and never resize them); source slots
    stay unchanged from :meth:`send` until the request's terminal event, and destination slots
    are not the engine's from :meth:`expect` until its terminal event. kvferry registers the
    pools with UCX and writes nowhere else. Nothing can check this: breaking it corrupts
    memory.

    Every method releases the GIL while the agent works and may be called from any thread.
    """

    def __new__(cls, config_json: str, keep_alive: Sequence[object] | None = ...) -> Self:
        """Starts the agent from the configuration, JSON or TOML text (version 1;
        ``host/capi/README.md`` lists every field and the environment variables that fill
        what it leaves out). ``keep_alive``: objects (the pools) referenced until
        :meth:`close`. Raises :class:`Error` (kind ``config``, ``planner``, ``ucx``,
        ``memory``, ``listen``, ``resources``)."""

    @property
    def closed(self) -> bool: ...
    def endpoint(self) -> str | None:
        """A prefill rank's side-channel endpoint (``host:port``, what decode ranks pass to
        :meth:`expect`); None on a decode rank."""

    def local_metadata(self) -> bytes:
        """This rank's metadata, for a decode rank's :meth:`add_peer` (engines that exchange
        it on their own channel)."""

    def add_peer(self, metadata: bytes) -> str:
        """Decode ranks: adds a prefill rank's :meth:`local_metadata`; returns its identity.
        Kinds ``role``, ``metadata``."""

    def send(
        self,
        request: int,
        tables: Sequence[_SlotTable],
        token_start: int,
        token_end: int,
        prompt_len: int,
        is_last: bool,
        to: str | None = ...,
        views: Sequence[tuple[int, int]] | None = ...,
    ) -> None:
        """Prefill ranks: makes tokens ``[token_start, token_end)`` of a ``prompt_len``-token
        prompt available from the slots of ``tables`` (one per layer group, with an entry, or
        -1 for a block this rank does not hold, for every block up to ``token_end``: a shorter
        table is refused, kind ``invalid``). Chunked prefill is a sequence of sends, the last with
        ``is_last``. ``to``: only this decode instance may claim it. ``views``: a layer-wise
        send carries only these ``(group, view)`` pairs (the layers computed so far); the next
        sends repeat its tokens with the views not sent yet, ``is_last`` on the one that ends
        the prompt and its views (None: every view not sent yet). Ends in ``sent``,
        ``cancelled`` or ``failed``. Kinds ``role``, ``invalid``, ``duplicate``, ``stopped``;
        ``TypeError`` for tables that are not int32."""

    def stats(self) -> dict[str, Any]:
        """What the agent did since it started: ``sent``, ``received``, ``cancelled``,
        ``failed`` (kind name -> count, every kind), ``bytes``, ``fragments``, ``pieces``,
        ``puts``, ``plan_ns``, ``write_ns``, ``queue_ns``, ``latency_us`` (entry k counts
        requests that took under 2**k microseconds, the last one every longer one),
        ``latency_sum_us``, ``plan_us`` and ``queue_us`` (the same requests by planning and by
        queueing time, bucketed alike), and ``in_flight`` and ``peers`` now."""

    def metrics_text(self) -> str:
        """The same numbers in the Prometheus text format (version 0.0.4), labelled with this
        agent's instance, rank and role (``kvferry_requests_total{outcome=...}``,
        ``kvferry_transfer_bytes_total``, ``kvferry_transfer_duration_seconds``, ...)."""

    def hold(self, peer: str, endpoints: Sequence[str], requests: Sequence[int]) -> None:
        """Decode ranks: tells prefill instance ``peer`` (through ``endpoints``, or the ranks
        added with :meth:`add_peer` when empty) that this instance still wants ``requests``,
        which its engine queued: their leases run again from now, up to ten leases after their
        send. Returns at once; call it well within the lease while they stay queued."""

    def expect(
        self,
        request: int,
        peer: str,
        endpoints: Sequence[str],
        ctx_dp_rank: int,
        prompt_len: int,
        tables: Sequence[_SlotTable],
        cached_prefix: int | None = ...,
        excluded_views: Sequence[tuple[int, int]] = ...,
    ) -> None:
        """Decode ranks: expects request ``request`` from prefill instance ``peer`` (whose
        ranks listen on ``endpoints``; may be empty after :meth:`add_peer`) into ``tables``
        (one per layer group, with an entry, or -1, for every block of the prompt: a shorter
        table is refused, kind ``invalid``, before anything moves).
        ``cached_prefix``: tokens already here (block-aligned), never written.
        ``excluded_views``: ``(group, view)`` pairs of this rank not to write. Ends in
        ``received``, ``cancelled`` or ``failed``."""

    def cancel(self, request: int) -> None:
        """Cancels a request; its terminal event answers (``cancelled``, or the event that
        beat the cancel). Kind ``unknown`` if it is unknown or has ended."""

    def poll(self) -> list[Event]:
        """Drains the events that wait, oldest first (and clears the wake descriptor)."""

    def wake_fd(self) -> int:
        """A descriptor readable while events wait (for ``select``/``poll``/``epoll``); owned
        by the agent: never close or read it."""

    def close(self) -> None:
        """Stops the agent: tells every peer, ends every connection and waits (up to 2 s) for
        its threads, so UCX has let go of the pools when it returns. Requests still in flight
        end without events. Idempotent; later calls raise :class:`Error` (``stopped``)."""

    def __enter__(self) -> Self: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]: ...

@final
class PairPlanner:
    """kvferry's planner for one (prefill rank, decode rank) pair, without an agent: for an
    engine that moves the bytes with another transfer layer (NIXL, Mooncake, its own copies).

    Built from the JSON configurations the two ranks' agents would read (roles ``context`` and
    ``generation``; no secret, listener or transport is needed): each side's planner is bound
    and started on its rank, and each vets the other. Nothing is connected or registered.
    Raises :class:`Error` (kind ``config``, ``planner``, ``invalid`` for a configuration of
    the wrong role)."""

    def __new__(cls, prefill_config: str, decode_config: str) -> Self: ...
    @property
    def writes(self) -> bool:
        """Whether the prefill rank writes the decode rank at all (the planner's targets for
        the decode rank's DP group); a pair it does not write has nothing to plan."""

    @property
    def planner_id(self) -> str:
        """The bound planner's id."""

    def plan(
        self,
        prefill_tables: Sequence[_SlotTable],
        decode_tables: Sequence[_SlotTable],
        token_start: int,
        token_end: int,
        prompt_len: int,
        dst_start_token: int | None = ...,
        views: Sequence[tuple[int, int]] | None = ...,
    ) -> Plan:
        """Plans tokens ``[token_start, token_end)`` of a ``prompt_len``-token prompt from the
        prefill rank's slots to the decode rank's (one slot table per layer group on each
        side, with an entry, or -1, for every block up to ``token_end``: a shorter table is
        refused, kind ``invalid``) and validates the plan as the agent does before a byte moves: every source
        inside the prefill rank's slots for the request, every destination inside the decode
        rank's, no destination byte written twice. ``dst_start_token``: where the decode copy
        starts (a cached prefix). ``views``: the prefill rank's ``(group, view)`` pairs this
        piece carries (layer-wise). Kinds ``invalid`` (tables, tokens, views, a pair the
        prefill rank does not write) and ``planner`` (its refusal, or a plan that broke a
        rule)."""

@final
class Plan:
    """A validated plan from :meth:`PairPlanner.plan`: addresses in the two ranks' pools as
    their configurations declare them."""

    #: Bytes it moves.
    bytes: int
    #: Fragments once expanded (``len(plan)`` too).
    fragments: int
    def patterns(self) -> list[tuple[list[tuple[int, int, int]], list[tuple[int, int]]]]:
        """The plan as patterns, ``(fragments, rows)``: each ``(src_offset, dst_offset,
        length)`` fragment lands once per ``(src_row, dst_row)`` pair. A flat plan is one
        pattern whose only row pair is ``(0, 0)``."""

    def expand(self) -> list[tuple[int, int, int]]:
        """Every fragment as ``(src_address, dst_address, length)``, in plan order: the
        descriptor lists another transfer layer takes."""

    def __len__(self) -> int: ...
