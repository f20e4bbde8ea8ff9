"""kvferry: move a request's KV cache from a prefill (context) rank to a decode (generation)
rank with UCX one-sided writes.

One :class:`Agent` per engine rank, over the engine's own KV pools, configured by the same
versioned JSON object as the C API (``host/capi/README.md``, "The configuration"). See
``python/README.md`` for an example and ``kvferry/__init__.pyi`` for every method.
"""

from ._kvferry import CONFIG_VERSION, Agent, Error, Event, __version__

__all__ = ["Agent", "CONFIG_VERSION", "Error", "Event", "__version__"]
