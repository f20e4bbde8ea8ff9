"""kvferry: move a request's KV cache from a prefill (context) rank to a decode (generation)
rank with UCX one-sided writes.

One :class:`Agent` per engine rank, over the engine's own KV pools, configured by the same
versioned JSON object as the C API (``host/capi/README.md``, "The configuration"). See
``python/README.md`` for an example and ``kvferry/__init__.pyi`` for every method.

The planners ship inside the package (``kvferry/planners``): an agent whose configuration
names no ``plugin_dir`` loads them from there, or from ``KVFERRY_PLUGIN_DIR`` when it is set.
UCX comes from the ``libucx-cu12`` wheel, loaded here before the extension (the way ucxx and
NIXL load it); ``KVFERRY_UCX=system`` skips that, for a process that already loads its own
UCX (exactly one UCX may live in a process). :func:`doctor` says what loaded.

kvferry logs through :mod:`logging`, to loggers under ``kvferry`` (``kvferry.transfer.agent``
and the like): the ``kvferry`` logger's level when an agent starts chooses what is recorded,
unless ``KVFERRY_LOG`` (or ``RUST_LOG``) is set.
"""

import atexit
import os


def _load_ucx() -> None:
    if os.environ.get("KVFERRY_UCX", "").lower() == "system":
        return
    try:
        import libucx  # the libucx-cu12 wheel, a dependency of the kvferry wheel
    except ImportError:
        # A build in the checkout finds UCX through the extension's RUNPATH.
        return
    libucx.load_library()


_load_ucx()

from ._kvferry import (  # noqa: E402 (UCX must be loaded first)
    CONFIG_VERSION,
    Agent,
    Error,
    Event,
    PairPlanner,
    Plan,
    __version__,
    doctor,
    flush_logs,
)

from .describe import agent_config, describe_paged_cache  # noqa: E402

#: The planners shipped in this package (an agent's default plugin directory).
PLUGIN_DIR = os.path.join(os.path.dirname(__file__), "planners")

__all__ = [
    "Agent",
    "CONFIG_VERSION",
    "Error",
    "Event",
    "PLUGIN_DIR",
    "PairPlanner",
    "Plan",
    "__version__",
    "agent_config",
    "describe_paged_cache",
    "doctor",
    "flush_logs",
]

# Records raised on kvferry's threads reach Python on one of its own; hand over what is left
# before the interpreter goes.
atexit.register(flush_logs)
