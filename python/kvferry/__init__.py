"""kvferry: move a request's KV cache from a prefill (context) rank to a decode (generation)
rank with UCX one-sided writes.

One :class:`Agent` per engine rank, over the engine's own KV pools, configured by the same
versioned JSON object as the C API (``host/capi/README.md``, "The configuration"). See
``python/README.md`` for an example and ``kvferry/__init__.pyi`` for every method.

kvferry logs through :mod:`logging`, to loggers under ``kvferry`` (``kvferry.transfer.agent``
and the like): the ``kvferry`` logger's level when an agent starts chooses what is recorded,
unless ``KVFERRY_LOG`` (or ``RUST_LOG``) is set.
"""

import atexit

from ._kvferry import CONFIG_VERSION, Agent, Error, Event, __version__, flush_logs

__all__ = ["Agent", "CONFIG_VERSION", "Error", "Event", "__version__", "flush_logs"]

# Records raised on kvferry's threads reach Python on one of its own; hand over what is left
# before the interpreter goes.
atexit.register(flush_logs)
