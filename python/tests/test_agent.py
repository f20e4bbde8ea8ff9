"""The Python binding end to end, in one process: a prefill (context) agent and a decode
(generation) agent over numpy pools, the bytes checked one by one; then every refusal.

The layout is the C test's (host/capi/tests/c/transfer.c): a small GQA model, 2 layers of
2 KV heads x 32 bf16 elements, K and V, 16 tokens per block, one PAGED group, one pool, one
HND view {key, value}, tp1. The prefill packs layers back to back in 16 slots; the decode stores
them last first with a 128-byte gap, pads every slot by 256 bytes and has 12 slots, so the
planner (kvferry.default) has to map one onto the other.

The planner is loaded from KVFERRY_TEST_PLUGIN_DIR, else from the checkout's
target/{release,debug}/libkvferry_planner_default.so (scripts/test-python builds it).
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import select
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

import kvferry

LAYERS, HEADS, HEAD_DIM, ELEM_BYTES, TPB = 2, 2, 32, 2, 16
ROW = HEAD_DIM * ELEM_BYTES  # one head of one token
BUFFER = HEADS * TPB * ROW  # one layer's K (or V) of one block: [head][token][dim]
REGION = 2 * BUFFER  # one layer: K then V
CANARY, FOREIGN = 0xA5, 0x5A
SECRET = "kvferry python test secret"
SALT_PREFILL, SALT_CACHED = "prefill", "cached"
REPO = Path(__file__).resolve().parents[2]


def blocks(tokens: int) -> int:
    return (tokens + TPB - 1) // TPB


class Side:
    """One engine rank's pool (a numpy array the side keeps alive) and how it lays slots out."""

    def __init__(self, name, role, slots, layer_gap=0, slot_padding=0, reversed_=False, fill=0):
        self.name, self.role, self.slots = name, role, slots
        self.layer_offset = [
            ((LAYERS - 1 - layer) if reversed_ else layer) * (REGION + layer_gap)
            for layer in range(LAYERS)
        ]
        self.slot_bytes = LAYERS * REGION + (LAYERS - 1) * layer_gap
        self.stride = self.slot_bytes + slot_padding
        self.footprint = (slots - 1) * self.stride + self.slot_bytes
        self.pool = np.zeros(self.footprint, dtype=np.uint8)
        self.pool[:] = fill

    def config(self, plugin_dir: str, transport: str, **extra) -> str:
        entries = [
            {"local_layer": layer, "offset": self.layer_offset[layer] + kv * BUFFER, "size": BUFFER}
            for layer in range(LAYERS)
            for kv in range(2)
        ]
        config = {
            "version": kvferry.CONFIG_VERSION,
            "instance": f"{self.name}-py",
            "role": self.role,
            "label": "python test gqa 2x2x32",
            "architecture": "LlamaForCausalLM",
            "planner": "kvferry.default",
            "plugin_dir": plugin_dir,
            "transport": transport,
            "listen": "127.0.0.1:0",
            "secret": SECRET,
            "timeout_ms": 10000,
            "lease_ms": 10000,
            "rank": {
                "mapping": "tp1",
                "instance_rank": 0,
                "layers_per_pp": [LAYERS],
                "page_table": {
                    "tokens_per_block": TPB,
                    "pools": [
                        {
                            "base": self.pool.ctypes.data,
                            "slot_bytes": self.slot_bytes,
                            "slot_stride": self.stride,
                            "num_slots": self.slots,
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
                                        "elem_bits": ELEM_BYTES * 8,
                                        "shard_unit_bytes": TPB * ROW,
                                    },
                                }
                            ],
                        }
                    ],
                },
            },
        }
        config.update(extra)
        return json.dumps(config)

    def row_offset(self, slot, layer, kv, head, token) -> int:
        return (
            slot * self.stride
            + self.layer_offset[layer]
            + kv * BUFFER
            + head * TPB * ROW
            + (token % TPB) * ROW
        )

    def rows(self, slots, first_block, last_block):
        """(offset, layer, kv, head, token) of every row of blocks [first, last)."""
        for b in range(first_block, last_block):
            for t in range(b * TPB, (b + 1) * TPB):
                for layer in range(LAYERS):
                    for kv in range(2):
                        for h in range(HEADS):
                            yield self.row_offset(int(slots[b]), layer, kv, h, t), layer, kv, h, t

    def fill(self, slots, request, first_block, last_block, salt):
        for at, layer, kv, h, t in self.rows(slots, first_block, last_block):
            self.pool[at : at + ROW] = pattern(salt, request, layer, kv, h, t)


def pattern(salt, request, layer, kv, head, token) -> np.ndarray:
    digest = hashlib.blake2b(
        f"{salt}/{request}/{layer}/{kv}/{head}/{token}".encode(), digest_size=ROW
    ).digest()
    return np.frombuffer(digest, dtype=np.uint8)


# (id, prompt_len, first chunk's tokens or 0, decode-side cached prefix, prefill slots, decode slots)
REQUESTS = [
    # 40 tokens: 3 blocks, the last partial; one send.
    (101, 40, 0, 0, [5, 0, 9], [3, 10, 1]),
    # One block; the decode side names no endpoint (add_peer's metadata only).
    (102, 16, 0, 0, [14], [7]),
    # 50 tokens in two chunks (32 + 18); the decode side has the first block cached.
    (103, 50, 32, 16, [2, 11, 7, 3], [11, 0, 5, 8]),
]


@pytest.fixture(scope="session")
def plugin_dir(tmp_path_factory) -> str:
    found = os.environ.get("KVFERRY_TEST_PLUGIN_DIR")
    if found:
        return found
    candidates = [
        REPO / "target" / profile / "libkvferry_planner_default.so"
        for profile in ("release", "debug")
    ]
    candidates = [c for c in candidates if c.exists()]
    if not candidates:
        pytest.fail(
            "no libkvferry_planner_default.so: run `cargo build --release -p "
            "kvferry-planner-default` or set KVFERRY_TEST_PLUGIN_DIR"
        )
    newest = max(candidates, key=lambda c: c.stat().st_mtime)
    # A directory of its own: every .so in a plugin directory is loaded.
    out = tmp_path_factory.mktemp("planners")
    shutil.copy(newest, out / newest.name)
    return str(out)


def wait(agents, want, limit_s=20.0):
    """Waits on the agents' wake descriptors with select and drains their events until each
    agent has `want` of them; {agent index: {request: Event}}."""
    got = [{} for _ in agents]
    fds = {a.wake_fd(): i for i, a in enumerate(agents)}
    deadline = time.monotonic() + limit_s
    while any(len(g) < want for g in got):
        left = deadline - time.monotonic()
        assert left > 0, f"timed out; events so far: {got}"
        ready, _, _ = select.select(list(fds), [], [], left)
        for fd in ready:
            i = fds[fd]
            for event in agents[i].poll():
                assert event.request not in got[i], f"two terminal events: {event!r}"
                got[i][event.request] = event
    return got


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_transfer_checks_every_byte(plugin_dir, transport):
    prefill = Side("prefill", "context", slots=16, fill=FOREIGN)
    decode = Side(
        "decode", "generation", slots=12, layer_gap=128, slot_padding=256, reversed_=True,
        fill=CANARY,
    )
    ctx = kvferry.Agent(prefill.config(plugin_dir, transport), keep_alive=[prefill.pool])
    gen = kvferry.Agent(decode.config(plugin_dir, transport), keep_alive=[decode.pool])
    with ctx, gen:
        endpoint = ctx.endpoint()
        assert endpoint and endpoint.startswith("127.0.0.1:")
        assert gen.endpoint() is None
        identity = gen.add_peer(ctx.local_metadata())
        assert "prefill-py" in identity

        for rid, prompt_len, chunk, _, slots, _ in REQUESTS:
            table = np.array(slots, dtype=np.int32)
            n = blocks(prompt_len)
            start = 0
            if chunk:
                first = blocks(chunk)
                prefill.fill(slots, rid, 0, first, SALT_PREFILL)
                ctx.send(rid, [table[:first]], 0, chunk, prompt_len, False, to="decode-py")
                prefill.fill(slots, rid, first, n, SALT_PREFILL)
                start = chunk
            else:
                prefill.fill(slots, rid, 0, n, SALT_PREFILL)
            # A chunked request names its receiver on every chunk.
            ctx.send(rid, [table], start, prompt_len, prompt_len, True, "decode-py" if chunk else None)

        for rid, prompt_len, _, cached, _, slots in REQUESTS:
            decode.fill(slots, rid, 0, blocks(cached), SALT_CACHED)
            # Request 102's table is a plain list of ints, the others array.array and numpy.
            table = slots if rid == 102 else array.array("i", slots) if rid == 101 else np.array(
                slots, dtype=np.int32
            )
            gen.expect(
                rid,
                "prefill-py",
                [] if rid == 102 else [endpoint],
                0,
                prompt_len,
                [table],
                cached_prefix=cached or None,
            )

        sent, received = wait([ctx, gen], len(REQUESTS))
        for rid, *_ in REQUESTS:
            assert sent[rid].kind == "sent", repr(sent[rid])
            assert received[rid].kind == "received", repr(received[rid])
            assert received[rid].bytes > 0 and received[rid].writers == 1
            assert "received" in repr(received[rid])
        assert sum(e.bytes for e in sent.values()) == sum(e.bytes for e in received.values())
        # The agents' own counters agree.
        sends, loads = ctx.stats(), gen.stats()
        assert sends["sent"] == loads["received"] == len(REQUESTS), (sends, loads)
        assert sends["bytes"] == loads["bytes"] == sum(e.bytes for e in sent.values())
        assert sum(loads["latency_us"]) == len(REQUESTS) and loads["in_flight"] == 0
        assert set(loads["failed"]) >= {"lease", "peer", "timeout"}
        assert sum(loads["failed"].values()) == 0 and loads["peers"] == 1
        assert sum(loads["plan_us"]) == sum(loads["queue_us"]) == len(REQUESTS)
        assert loads["latency_sum_us"] > 0
        # And the same numbers for Prometheus.
        text = gen.metrics_text()
        labels = 'kvferry_instance="decode-py",rank="0",role="decode"'
        assert f'kvferry_requests_total{{{labels},outcome="received"}} {len(REQUESTS)}' in text
        assert f"kvferry_transfer_bytes_total{{{labels}}} {loads['bytes']}" in text
        assert f"kvferry_transfer_duration_seconds_count{{{labels}}} {len(REQUESTS)}" in text
        assert 'kvferry_build_info{version="' in text
        # Prometheus keeps the label `instance` for the scraped target.
        assert '{instance="' not in text and ',instance="' not in text
    assert ctx.closed and gen.closed

    # Every byte of the decode pool: received rows hold the prefill's pattern, cached rows
    # their own, rows past the prompt in a last block the pattern or the canary (whole rows),
    # and every other byte (gaps, padding, other slots) the canary.
    claimed = np.zeros(decode.footprint, dtype=bool)
    landed = 0
    for rid, prompt_len, _, cached, _, slots in REQUESTS:
        for at, layer, kv, h, t in decode.rows(slots, 0, blocks(prompt_len)):
            row = decode.pool[at : at + ROW]
            claimed[at : at + ROW] = True
            if t < cached:
                want = pattern(SALT_CACHED, rid, layer, kv, h, t)
                assert np.array_equal(row, want), f"cached row {rid}/{layer}/{kv}/{h}/{t}"
            elif t < prompt_len:
                want = pattern(SALT_PREFILL, rid, layer, kv, h, t)
                assert np.array_equal(row, want), f"row {rid}/{layer}/{kv}/{h}/{t} is wrong"
                landed += 1
            else:
                want = pattern(SALT_PREFILL, rid, layer, kv, h, t)
                assert np.array_equal(row, want) or np.all(row == CANARY), f"tail row {rid}/{t}"
    outside = decode.pool[~claimed]
    bad = np.flatnonzero(outside != CANARY)
    assert bad.size == 0, f"{bad.size} bytes outside the requests lost their canary"
    assert landed == sum(
        (p - c) * LAYERS * 2 * HEADS for _, p, _, c, _, _ in REQUESTS
    ), "not every row landed"

    # The sources are the engine's again, unchanged.
    for rid, prompt_len, _, _, slots, _ in REQUESTS:
        for at, layer, kv, h, t in prefill.rows(slots, 0, blocks(prompt_len)):
            assert np.array_equal(
                prefill.pool[at : at + ROW], pattern(SALT_PREFILL, rid, layer, kv, h, t)
            )


@pytest.fixture
def pair(plugin_dir):
    prefill = Side("prefill", "context", slots=4)
    decode = Side("decode", "generation", slots=4)
    ctx = kvferry.Agent(prefill.config(plugin_dir, "tcp"), keep_alive=[prefill.pool])
    gen = kvferry.Agent(decode.config(plugin_dir, "tcp"), keep_alive=[decode.pool])
    yield ctx, gen
    ctx.close()
    gen.close()


def error_of(call, *args, **kwargs) -> kvferry.Error:
    with pytest.raises(kvferry.Error) as info:
        call(*args, **kwargs)
    e = info.value
    assert str(e).endswith(e.detail)
    return e


def test_config_refusals(plugin_dir):
    side = Side("prefill", "context", slots=4)
    e = error_of(kvferry.Agent, "{not json")
    assert e.kind == "config" and "not JSON" in e.detail and e.peer is None
    assert str(e).startswith("kvferry.Agent: ")

    good = json.loads(side.config(plugin_dir, "tcp"))
    e = error_of(kvferry.Agent, json.dumps({**good, "version": 2}))
    assert e.kind == "config" and "version 2 is not supported" in e.detail

    e = error_of(kvferry.Agent, json.dumps({**good, "trasnport": "tcp"}))
    assert e.kind == "config" and "trasnport" in e.detail

    e = error_of(kvferry.Agent, json.dumps({**good, "planner": "no.such.planner"}))
    assert e.kind == "planner", e

    e = error_of(kvferry.Agent, json.dumps({**good, "secret": "short"}))
    assert e.kind == "config", e
    assert isinstance(e, Exception)


def test_call_refusals(pair):
    ctx, gen = pair
    e = error_of(ctx.cancel, 12345)
    assert e.kind == "unknown" and "12345" in e.detail

    e = error_of(ctx.expect, 7, "prefill-py", [], 0, 16, [[0]])
    assert e.kind == "role"
    e = error_of(gen.send, 7, [[0]], 0, 16, 16, True)
    assert e.kind == "role"
    e = error_of(gen.add_peer, b"not metadata")
    assert e.kind == "metadata"

    # A decode rank refuses a second expect of an id it holds, atomically.
    endpoint = ctx.endpoint()
    gen.expect(8, "prefill-py", [endpoint], 0, 16, [np.array([1], dtype=np.int32)])
    e = error_of(gen.expect, 8, "prefill-py", [endpoint], 0, 16, [np.array([2], dtype=np.int32)])
    assert e.kind == "duplicate" and "8" in e.detail
    gen.cancel(8)
    (event,) = wait([gen], 1)[0].values()
    assert event.kind == "cancelled" and event.request == 8
    assert "cancelled" in repr(event)

    # A prefill rank refuses a second send of an id in flight (its last chunk in, not ended)
    # as a duplicate too; a later chunk of it is one of a request that takes no more.
    ctx.send(10, [np.array([1], dtype=np.int32)], 0, 16, 16, True)
    e = error_of(ctx.send, 10, [np.array([2], dtype=np.int32)], 0, 16, 16, True)
    assert e.kind == "duplicate" and "request 10 already exists" in e.detail, e
    e = error_of(ctx.send, 10, [np.array([2], dtype=np.int32)], 8, 16, 16, True)
    assert e.kind == "unknown" and "10" in e.detail, e

    e = error_of(ctx.send, 9, [[99]], 0, 16, 16, True)
    assert e.kind == "invalid", e

    # Tables short of the tokens: 40 tokens of 16-token blocks take three
    # entries; two used to move 32 tokens and report the request whole. Refused at the
    # call, on either side, as the engine's own error.
    two = [np.array([0, 1], dtype=np.int32)]
    e = error_of(gen.expect, 12, "prefill-py", [endpoint], 0, 40, two)
    assert e.kind == "invalid" and "2 entries of 16 tokens" in e.detail, e
    assert "run to 40" in e.detail and "takes 3 entries" in e.detail, e
    e = error_of(ctx.send, 12, two, 0, 40, 40, True)
    assert e.kind == "invalid" and "takes 3 entries" in e.detail, e
    e = error_of(ctx.send, 12, [np.array([2, 2, 3], dtype=np.int32)], 0, 40, 40, True)
    assert e.kind == "invalid" and "slot 2 is named for blocks 0 and 1" in e.detail, e

    # Layer-wise sends name views of the rank's page table (it has one: group 0, view 0).
    table = [np.array([3], dtype=np.int32)]
    e = error_of(ctx.send, 11, table, 0, 16, 16, True, views=[(4, 0)])
    assert e.kind == "invalid" and "(group 4, view 0)" in e.detail, e
    e = error_of(ctx.send, 11, table, 0, 16, 16, True, views=[])
    assert e.kind == "invalid" and "names no view" in e.detail, e
    ctx.send(11, table, 0, 16, 16, True, views=[(0, 0)])


def test_reprs_print_values_not_rust_options(pair):
    """An agent's repr names it, with the endpoint a prefill rank listens on, and nothing for
    the decode rank's (it has none): no Rust `Some(...)` or `None`."""
    ctx, gen = pair
    endpoint = ctx.endpoint()
    assert endpoint.startswith("127.0.0.1:"), endpoint
    assert repr(ctx) == (
        f"<kvferry.Agent instance='prefill-py' rank=0 role='prefill' endpoint='{endpoint}'>"
    )
    assert gen.endpoint() is None
    assert repr(gen) == "<kvferry.Agent instance='decode-py' rank=0 role='decode'>"


def test_tables_must_be_int32(pair):
    ctx, _ = pair
    with pytest.raises(TypeError, match="int32"):
        ctx.send(1, [np.zeros(3, dtype=np.int64)], 0, 16, 16, True)
    with pytest.raises(TypeError, match="int32"):
        ctx.send(1, [np.zeros(3, dtype=np.float32)], 0, 16, 16, True)
    with pytest.raises(TypeError, match="int32"):
        ctx.send(1, [b"\x00\x01"], 0, 16, 16, True)
    with pytest.raises(TypeError, match="C-contiguous"):
        ctx.send(1, [np.arange(8, dtype=np.int32)[::2]], 0, 16, 16, True)
    with pytest.raises(TypeError, match="1-dimensional"):
        ctx.send(1, [np.zeros((2, 2), dtype=np.int32)], 0, 16, 16, True)
    with pytest.raises(TypeError, match="one buffer"):
        ctx.send(1, np.zeros(2, dtype=np.int32), 0, 16, 16, True)
    with pytest.raises(TypeError, match="int32"):
        ctx.send(1, [[1, 2**40]], 0, 16, 16, True)
    with pytest.raises(TypeError):
        ctx.send(1, ["ab"], 0, 16, 16, True)
    # Nothing was taken: the id is still free.
    ctx.send(1, [np.array([0], dtype=np.int32)], 0, 16, 16, True)
    ctx.cancel(1)


def test_closed_agent_refuses(pair):
    ctx, _ = pair
    fd = ctx.wake_fd()
    assert fd >= 0
    ctx.close()
    ctx.close()
    assert ctx.closed and "closed" in repr(ctx)
    e = error_of(ctx.poll)
    assert e.kind == "stopped"
    e = error_of(ctx.send, 1, [[0]], 0, 16, 16, True)
    assert e.kind == "stopped"


def test_collected_without_close_and_used_from_threads(plugin_dir):
    import gc
    import threading

    side = Side("prefill", "context", slots=4)
    agent = kvferry.Agent(side.config(plugin_dir, "tcp"), keep_alive=[side.pool])
    errors = []

    def worker(i):
        try:
            agent.send(100 + i, [np.array([i], dtype=np.int32)], 0, 16, 16, True)
            agent.cancel(100 + i)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    events = wait([agent], 4)[0]
    assert sorted(events) == [100, 101, 102, 103]
    assert all(e.kind == "cancelled" for e in events.values())
    # Dropped without close(): collection quiesces it as close() does.
    del agent
    gc.collect()
    again = kvferry.Agent(side.config(plugin_dir, "tcp"), keep_alive=[side.pool])
    again.close()


def test_interpreter_exits_with_a_live_agent(plugin_dir, tmp_path):
    """An agent still open at exit (module global, never closed) quiesces at shutdown: the
    process exits 0, promptly, and prints no panic."""
    import subprocess
    import sys

    script = tmp_path / "live.py"
    script.write_text(
        "import sys, numpy as np, kvferry\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from test_agent import Side\n"
        "side = Side('prefill', 'context', slots=4)\n"
        "agent = kvferry.Agent(side.config(sys.argv[2], 'tcp'), keep_alive=[side.pool])\n"
        "agent.send(1, [[0]], 0, 16, 16, True)\n"
        "print('started', agent.endpoint())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, str(script), str(Path(__file__).parent), plugin_dir],
        capture_output=True, text=True, timeout=30, env=env,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("started 127.0.0.1:"), out.stdout
    assert "panic" not in out.stderr, out.stderr
    assert time.monotonic() - started < 10


LOG_SCRIPT = """
import json, logging, sys
sys.path.insert(0, sys.argv[1])
import kvferry
from test_agent import Side

records = []


class Keep(logging.Handler):
    def emit(self, record):
        records.append([record.name, record.levelname, record.getMessage()])


logging.getLogger().addHandler(Keep())
side = Side("prefill", "context", slots=4)


def start_and_close():
    kvferry.Agent(side.config(sys.argv[2], "tcp"), keep_alive=[side.pool]).close()
    assert kvferry.flush_logs(10.0)


start_and_close()  # the kvferry logger at WARNING, the default
quiet = len(records)
logging.getLogger("kvferry").setLevel(logging.INFO)
start_and_close()
print(json.dumps({"quiet": records[:quiet], "info": records[quiet:]}))
"""


@pytest.mark.parametrize("env_filter", [None, "kvferry=loud"])
def test_logs_reach_python_logging(plugin_dir, tmp_path, env_filter):
    """kvferry's records reach Python's logging, from the loggers of their modules, at the
    kvferry logger's level; none go to stderr past logging; a bad KVFERRY_LOG is named."""
    import subprocess
    import sys

    script = tmp_path / "logs.py"
    script.write_text(LOG_SCRIPT)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LD_LIBRARY_PATH", "RUST_LOG", "KVFERRY_LOG")
    }
    if env_filter:
        env["KVFERRY_LOG"] = env_filter
    out = subprocess.run(
        [sys.executable, str(script), str(Path(__file__).parent), plugin_dir],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert out.returncode == 0, out.stderr
    # Nothing printed behind logging's back (no handler writes to stderr here).
    assert out.stderr == "", out.stderr
    got = json.loads(out.stdout)
    if env_filter is None:
        assert all(level in ("WARNING", "ERROR") for _, level, _ in got["quiet"]), got
        names = {(name, level) for name, level, _ in got["info"]}
        assert ("kvferry.transfer.agent", "INFO") in names, got
        stopped = [m for name, _, m in got["info"] if m.startswith("agent stopped")]
        assert len(stopped) == 1 and "open_requests=0" in stopped[0], got
        assert "agent=prefill-py" in stopped[0], got
        # Optional fields print their value, never a Rust `Some(...)`.
        started = [m for name, _, m in got["info"] if m.startswith("agent started")]
        assert len(started) == 1 and " endpoint=127.0.0.1:" in started[0], got
        assert not any("Some(" in m for _, _, m in got["quiet"] + got["info"]), got
    else:
        # The bad filter is named in a warning each start, and the default ("warn") applies
        # whatever the kvferry logger's level.
        warned = [
            m for _, level, m in got["quiet"] + got["info"]
            if level == "WARNING" and 'KVFERRY_LOG="kvferry=loud" is not a log filter' in m
        ]
        assert len(warned) == 2, got
        assert not any(level == "INFO" for _, level, _ in got["info"]), got


def test_doctor_says_what_loaded():
    d = kvferry.doctor()
    assert d["kvferry"] == kvferry.__version__
    assert d["planner_abi"].startswith("0.")
    assert d["extension"] and os.path.isfile(d["extension"])
    assert d["ucx"].startswith("1.")
    # The UCX mapped into this process is one copy of each core library.
    names = [os.path.basename(p).split(".so")[0] for p in d["ucx_libraries"]]
    assert "libucp" in names and len(names) == len(set(names)), d


def test_an_installed_package_plans_with_its_own_planners():
    """From the wheel (scripts/test-python installs it), an agent whose configuration names no
    plugin directory loads the planners shipped in the package."""
    if not os.path.isdir(kvferry.PLUGIN_DIR):
        pytest.skip("not an installed wheel: no planners in the package")
    if os.environ.get("KVFERRY_PLUGIN_DIR"):
        pytest.skip("KVFERRY_PLUGIN_DIR is set, so it is looked in instead")
    d = kvferry.doctor()
    assert d["plugin_dirs"] == [kvferry.PLUGIN_DIR], d
    ids = sorted(p["id"] for p in d["planners"])
    assert ids == ["kvferry.deepseek_mla_latent", "kvferry.default"], d
    assert not d["skipped"], d
    # Nothing the package loads lies outside the environment it is installed in.
    site = os.path.dirname(os.path.dirname(kvferry.__file__))
    assert d["extension"].startswith(site), d
    assert all(p.startswith(site) for p in d["ucx_libraries"]), d
    side = Side("prefill", "context", slots=4)
    config = json.loads(side.config("unused", "tcp"))
    del config["plugin_dir"]
    with kvferry.Agent(json.dumps(config), keep_alive=[side.pool]) as agent:
        assert agent.endpoint().startswith("127.0.0.1:")


def test_a_device_pool_is_refused_clearly_without_cuda(plugin_dir):
    """Without CUDA support built in, or without a driver, a VRAM pool is refused at start,
    naming why; the package itself imports and serves host memory either way."""
    side = Side("prefill", "context", slots=4)
    config = json.loads(side.config(plugin_dir, "tcp"))
    config["rank"]["page_table"]["pools"][0]["memory_type"] = "vram"
    config["cuda_device"] = 0
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has an NVIDIA driver (scripts/gpu-check covers device pools)")
    e = error_of(kvferry.Agent, json.dumps(config), keep_alive=[side.pool])
    assert e.kind in ("memory", "config"), e
    assert "cuda" in e.detail.lower(), e.detail
