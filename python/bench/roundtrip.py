"""Per-request overhead of the agent from Python: the transfer of
examples/src/bin/agent_roundtrip.rs (one prefill and one decode agent in this process, the
same JSON configuration, `expect`, `send`, then wait on both wake descriptors for both
terminal events), so the two medians compare the Python binding's cost with Rust's.

    python python/bench/roundtrip.py --requests 2000 --blocks 6 --plugin-dir target/release

with a Python that has kvferry installed (the wheel from `scripts/wheel`, or
`pip install ./python`) and numpy.
"""

from __future__ import annotations

import argparse
import json
import select
import time

import numpy as np

import kvferry

LAYERS, HEADS, ROW, TPB = 2, 2, 32 * 2, 16
BUFFER = HEADS * TPB * ROW
SLOT = LAYERS * 2 * BUFFER


def config(name, role, pool, slots, plugin_dir, transport):
    entries = [
        {"local_layer": layer, "offset": (layer * 2 + kv) * BUFFER, "size": BUFFER}
        for layer in range(LAYERS)
        for kv in range(2)
    ]
    return json.dumps(
        {
            "version": 1,
            "instance": name,
            "role": role,
            "architecture": "LlamaForCausalLM",
            "planner": "kvferry.default",
            "plugin_dir": plugin_dir,
            "transport": transport,
            "listen": "127.0.0.1:0",
            "secret": "kvferry roundtrip bench secret",
            "rank": {
                "mapping": "tp1",
                "instance_rank": 0,
                "layers_per_pp": [LAYERS],
                "page_table": {
                    "tokens_per_block": TPB,
                    "pools": [
                        {
                            "base": pool.ctypes.data,
                            "slot_bytes": SLOT,
                            "slot_stride": SLOT,
                            "num_slots": slots,
                            "memory_type": "dram",
                        }
                    ],
                    "groups": [
                        {
                            "kind": "paged",
                            "layers": [{"local": i, "global": i} for i in range(LAYERS)],
                            "views": [
                                {
                                    "pool": 0,
                                    "roles": ["key", "value"],
                                    "entries": entries,
                                    "layout": {
                                        "kind": "hnd",
                                        "dtype": "bf16",
                                        "elem_bits": 16,
                                        "shard_unit_bytes": TPB * ROW,
                                    },
                                }
                            ],
                        }
                    ],
                },
            },
        }
    )


def wait_terminal(agent, request):
    deadline = time.monotonic() + 30
    while True:
        for e in agent.poll():
            if e.request == request and e.kind in ("sent", "received", "cancelled", "failed"):
                return e
        if time.monotonic() > deadline:
            raise TimeoutError(f"request {request}: no terminal event within 30 s")
        select.select([agent.wake_fd()], [], [], 0.1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--plugin-dir", default="target/release")
    p.add_argument("--transport", default="shm")
    a = p.parse_args()
    slots = max(a.blocks, 1)
    src = np.full(slots * SLOT, 7, dtype=np.uint8)
    dst = np.zeros(slots * SLOT, dtype=np.uint8)
    ctx = kvferry.Agent(config("rt-prefill", "context", src, slots, a.plugin_dir, a.transport), keep_alive=src)
    gen = kvferry.Agent(config("rt-decode", "generation", dst, slots, a.plugin_dir, a.transport), keep_alive=dst)
    endpoint = ctx.endpoint()
    tables = [np.arange(a.blocks, dtype=np.int32)]
    prompt = a.blocks * TPB
    warmup = a.requests // 10
    times = []
    for rid in range(a.requests):
        started = time.perf_counter()
        gen.expect(rid, "rt-prefill", [endpoint], 0, prompt, tables)
        ctx.send(rid, tables, 0, prompt, prompt, True)
        received = wait_terminal(gen, rid)
        sent = wait_terminal(ctx, rid)
        if received.kind != "received" or sent.kind != "sent":
            raise RuntimeError(f"request {rid}: {received!r} / {sent!r}")
        if rid >= warmup:
            times.append((time.perf_counter() - started) * 1e6)
    if not np.array_equal(src, dst):
        raise RuntimeError("the destination does not hold the source's bytes")
    gen.close()
    ctx.close()
    times.sort()
    at = lambda q: times[min(int(q * len(times)), len(times) - 1)]  # noqa: E731
    print(
        f"python: {len(times)} requests of {a.blocks * SLOT} bytes over {a.transport}: "
        f"median {at(0.5):.1f} us, p90 {at(0.9):.1f} us, p99 {at(0.99):.1f} us"
    )


if __name__ == "__main__":
    main()
