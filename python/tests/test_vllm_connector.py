"""examples/python/kvferry_vllm_connector.py, played by a scheduler: a prefill connector
(kv_producer) and a decode connector (kv_consumer) in one process, each over its own numpy
KV caches in vLLM's paged layout and its own block allocator, no vLLM.

Every prompt token's K and V rows of every layer and head are filled on the prefill side
with a value derived from (layer, request, token, head, k/v, element); after the transfer
every destination row must hold it, a locally prefix-cached block its own value, and every
block the decode side never allocated its canary. The prefill's blocks are freed only after
``finished_sending`` and scribbled over when freed, so a send reported finished before its
bytes had left would show up as wrong rows. The layouts: NHD and HND in vLLM's FlashAttention
shape, HND in FlashInfer's; a TP 2 prefill (half the KV heads per worker) to a TP 1 decode;
failures (an unclaimed send, a load never sent, a refused load) reported finished with errors.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "python" / "kvferry_vllm_connector.py"

LAYERS, HEADS, HEAD_SIZE, BLOCK, NUM_BLOCKS = 3, 4, 16, 16, 64
CANARY = np.uint32(0xA5A5A5A5)  # never a pattern: its layer field (10) is >= LAYERS
SCRIBBLE = np.uint32(0xDEADBEEF)  # a freed prefill block
SECRET = "kvferry vllm connector test secret"


def load_example():
    spec = importlib.util.spec_from_file_location("kvferry_vllm_connector", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


conn = load_example()


@pytest.fixture(scope="module")
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
        pytest.fail("no libkvferry_planner_default.so: set KVFERRY_TEST_PLUGIN_DIR")
    newest = max(candidates, key=lambda c: c.stat().st_mtime)
    out = tmp_path_factory.mktemp("planners")  # every .so in a plugin directory is loaded
    shutil.copy(newest, out / newest.name)
    return str(out)


def pattern(layer: int, req: int, token: int, head: int, kv: int, salt: int = 0) -> np.ndarray:
    """One head's row of one token: 32-bit words, distinct for every field and element."""
    base = (layer << 28) | (req << 22) | (kv << 21) | (token << 12) | (head << 8) | (salt << 7)
    return np.uint32(base) + np.arange(HEAD_SIZE, dtype=np.uint32)


@dataclass
class Request:
    """The fields of vLLM's Request the connector reads."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class KVCacheBlocks:
    """vLLM's KVCacheBlocks of one KV cache group."""

    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (list(self.ids),)


@dataclass
class Engine:
    """One instance's KV caches (vLLM layer name -> array) and block allocator."""

    layout: str
    shape_kind: str
    fill: np.uint32
    #: The KV heads this rank holds: [head_offset, head_offset + heads) of the model's.
    heads: int = HEADS
    head_offset: int = 0
    caches: dict[str, np.ndarray] = field(default_factory=dict)
    free: list[int] = field(default_factory=lambda: list(range(NUM_BLOCKS)))
    ever_used: set[int] = field(default_factory=set)

    def __post_init__(self):
        h = self.heads
        inner = (BLOCK, h, HEAD_SIZE) if self.layout == "NHD" else (h, BLOCK, HEAD_SIZE)
        kv_first = self.shape_kind == "kv_first"
        shape = (2, NUM_BLOCKS, *inner) if kv_first else (NUM_BLOCKS, 2, *inner)
        # Registered out of layer order: the connector orders layers by their names' index.
        for layer in reversed(range(LAYERS)):
            cache = np.empty(shape, dtype=np.float32)
            cache.view(np.uint32)[...] = self.fill
            self.caches[f"model.layers.{layer}.self_attn.attn"] = cache

    def words(self, layer: int) -> np.ndarray:
        return self.caches[f"model.layers.{layer}.self_attn.attn"].view(np.uint32)

    def row(self, layer: int, kv: int, block: int, offset: int, head: int) -> np.ndarray:
        """The row of the model's KV head `head` (which this rank must hold)."""
        head -= self.head_offset
        assert 0 <= head < self.heads
        c = self.words(layer)
        at = (kv, block) if self.shape_kind == "kv_first" else (block, kv)
        return c[at + ((offset, head) if self.layout == "NHD" else (head, offset))]

    def block(self, layer: int, kv: int, block: int) -> np.ndarray:
        c = self.words(layer)
        return c[kv, block] if self.shape_kind == "kv_first" else c[block, kv]

    def allocate(self, n: int, scattered: bool = False) -> list[int]:
        if scattered:  # every other free block, last first: neither ascending nor dense
            ids = self.free[::2][:n][::-1]
        else:
            ids = self.free[:n]
        assert len(ids) == n, "out of blocks"
        for b in ids:
            self.free.remove(b)
        self.ever_used.update(ids)
        return ids

    def release(self, ids: list[int]) -> None:
        for b in ids:
            for layer in range(LAYERS):
                for kv in range(2):
                    self.block(layer, kv, b)[...] = SCRIBBLE
            self.free.append(b)

    def fill_prompt(self, req: int, blocks: list[int], tokens: range, salt: int = 0) -> None:
        for t in tokens:
            for layer in range(LAYERS):
                for kv in range(2):
                    for h in range(self.head_offset, self.head_offset + self.heads):
                        self.row(layer, kv, blocks[t // BLOCK], t % BLOCK, h)[...] = pattern(
                            layer, req, t, h, kv, salt
                        )


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK)


def connector(role: str, name: str, plugin_dir: str, engine: Engine, **extra) -> Any:
    c = conn.KVFerryConnector(
        role,
        {
            "instance": name,
            "plugin_dir": plugin_dir,
            "secret": SECRET,
            "transport": "tcp",
            "listen": "127.0.0.1:0",
            "kv_layout": engine.layout,
            "kv_shape": engine.shape_kind,
            "timeout_ms": 10000,
            "lease_ms": 10000,
            **extra,
        },
    )
    c.register_kv_caches(engine.caches)
    return c


def step(c: Any, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
    """One engine step of a connector: the scheduler's metadata, the worker's forward pass
    hooks, then get_finished."""
    meta = c.build_connector_meta(None)
    c.bind_connector_metadata(meta)
    c.start_load_kv(None)
    for layer in range(LAYERS):
        name = f"model.layers.{layer}.self_attn.attn"
        c.wait_for_layer_load(name)
        c.save_kv_layer(name, None, None)
    c.wait_for_save()
    sending, recving = c.get_finished(finished_req_ids)
    c.clear_connector_metadata()
    return sending or set(), recving or set()


# (request id, prompt length, prefill blocks scattered, decode blocks scattered,
#  decode-side prefix-cached tokens)
REQUESTS = [
    ("req-0", 40, False, False, 0),
    ("req-1", 17, False, True, 0),
    ("req-2", 77, True, False, 0),  # 5 blocks, the prefill's scattered
    ("req-3", 50, True, True, 16),  # the decode has the first block cached locally
    ("req-4", 5, False, False, 0),
    ("req-5", 32, False, False, 0),  # a multiple of the block size (vLLM allocates one more)
]


@pytest.mark.parametrize(
    "layout,shape_kind", [("NHD", "kv_first"), ("HND", "kv_first"), ("HND", "blocks_first")]
)
def test_prefill_to_decode(plugin_dir, layout, shape_kind):
    started = time.monotonic()
    pre_engine = Engine(layout, shape_kind, fill=np.uint32(0))
    dec_engine = Engine(layout, shape_kind, fill=CANARY)
    others = dec_engine.allocate(3)  # another request's blocks: the two sides' ids differ
    prefill = connector("kv_producer", "prefill-0", plugin_dir, pre_engine)
    decode = connector("kv_consumer", "decode-0", plugin_dir, dec_engine)
    try:
        # The prefill instance computes every prompt and finishes it.
        pre_blocks, params = {}, {}
        for i, (rid, n, pre_scattered, _, _) in enumerate(REQUESTS):
            req = Request(rid, list(range(n)), {"do_remote_decode": True})
            # vLLM allocates room for the first generated token too.
            pre_blocks[rid] = pre_engine.allocate(blocks_for(n + 1), pre_scattered)
            pre_engine.fill_prompt(i, pre_blocks[rid], range(n))
            delay_free, params[rid] = prefill.request_finished(req, pre_blocks[rid])
            assert delay_free is True
            assert params[rid]["remote_instance"] == "prefill-0"
            assert params[rid]["prompt_len"] == n and params[rid]["remote_request_id"] == rid
            assert params[rid]["remote_endpoints"] == [prefill.agent.endpoint()]
        # A request that did not ask for remote decode is freed at once, with no params.
        assert prefill.request_finished(Request("local", [1, 2, 3]), [60]) == (False, None)
        # The finished requests reach the worker; nothing is sent until a decode claims it.
        finished = {rid for rid, *_ in REQUESTS}
        sending, recving = step(prefill, finished)
        assert not sending and not recving

        # The decode instance gets each request with the prefill's kv_transfer_params.
        dec_blocks, cached_of = {}, {}
        for i, (rid, n, _, dec_scattered, cached) in enumerate(REQUESTS):
            req = Request(rid, list(range(n)), dict(params[rid]))
            local = []
            if cached:  # a local prefix-cache hit, with this side's own bytes
                local = dec_engine.allocate(blocks_for(cached))
                dec_engine.fill_prompt(i, local, range(cached), salt=1)
            count, is_async = decode.get_num_new_matched_tokens(req, cached)
            assert (count, is_async) == (n - cached, True)
            # Side-effect free: asking again answers the same.
            assert decode.get_num_new_matched_tokens(req, cached) == (count, True)
            ids = local + dec_engine.allocate(blocks_for(n + 1) - len(local), dec_scattered)
            dec_blocks[rid], cached_of[rid] = ids, cached
            decode.update_state_after_alloc(req, KVCacheBlocks(ids), count)
            # The second call vLLM makes after the load adds nothing.
            decode.update_state_after_alloc(req, KVCacheBlocks(ids), 0)
            assert decode.get_num_new_matched_tokens(req, n) == (0, False)
        assert any(b != sorted(b) for b in dec_blocks.values())
        assert any(b != sorted(b) for b in pre_blocks.values())

        # Engine steps until every request is received and every send has finished.
        sent, received = set(), set()
        deadline = time.monotonic() + 20
        while sent != finished or received != finished:
            assert time.monotonic() < deadline, f"sent {sent}, received {received}"
            _, recving = step(decode, set())
            assert not recving & received, "a request reported twice"
            received |= recving
            sending, _ = step(prefill, set())
            assert not sending & sent, "a request reported twice"
            for rid in sending:  # the scheduler frees the blocks now, and only now
                pre_engine.release(pre_blocks[rid])
            sent |= sending
            time.sleep(0.002)
        assert decode.take_transfer_errors() == {} and prefill.take_transfer_errors() == {}
        assert decode.get_block_ids_with_load_errors() == set()
    finally:
        prefill.shutdown()
        decode.shutdown()

    # Every prompt row of every layer, head, K and V in place; the cached block untouched.
    for i, (rid, n, _, _, _) in enumerate(REQUESTS):
        ids = dec_blocks[rid]
        for t in range(n):
            salt = 1 if t < cached_of[rid] else 0
            for layer in range(LAYERS):
                for kv in range(2):
                    for h in range(HEADS):
                        got = dec_engine.row(layer, kv, ids[t // BLOCK], t % BLOCK, h)
                        want = pattern(layer, i, t, h, kv, salt)
                        where = f"{rid} layer {layer} kv {kv} head {h} token {t}"
                        assert np.array_equal(got, want), where
        # A block past the prompt's (allocated for generated tokens) is not written.
        for b in ids[blocks_for(n):]:
            for layer in range(LAYERS):
                for kv in range(2):
                    assert np.all(dec_engine.block(layer, kv, b) == CANARY), f"{rid} block {b}"
    # Blocks the decode side never allocated, or gave another request, keep their canary.
    for b in (set(range(NUM_BLOCKS)) - dec_engine.ever_used) | set(others):
        for layer in range(LAYERS):
            for kv in range(2):
                assert np.all(dec_engine.block(layer, kv, b) == CANARY), f"block {b}"
    assert time.monotonic() - started < 5


def test_failures_are_reported_finished(plugin_dir):
    """A send nobody claims (lease), a load nobody sends (timeout) and a load the agent refuses
    end as finished requests with an error entry, never hanging."""
    pre_engine = Engine("NHD", "kv_first", fill=np.uint32(0))
    dec_engine = Engine("NHD", "kv_first", fill=CANARY)
    prefill = connector("kv_producer", "prefill-1", plugin_dir, pre_engine, lease_ms=500)
    decode = connector("kv_consumer", "decode-1", plugin_dir, dec_engine, timeout_ms=500)
    try:
        req = Request("orphan", list(range(20)), {"do_remote_decode": True})
        delay_free, params = prefill.request_finished(req, pre_engine.allocate(2))
        assert delay_free
        # The scheduler has not finished it in the worker's view yet: not reported even
        # once its send ends.
        assert step(prefill, set()) == (set(), set())

        # A load of a request the prefill never sent, and one into blocks that do not exist.
        missing = dict(params, kvferry_request=params["kvferry_request"] ^ 1, prompt_len=20)
        decode.update_state_after_alloc(Request("missing", list(range(20)), missing), [3, 4], 20)
        bad = dict(params)
        decode.update_state_after_alloc(Request("bad", list(range(20)), bad), [NUM_BLOCKS, 1], 20)

        received, deadline = set(), time.monotonic() + 10
        while received != {"missing", "bad"}:
            assert time.monotonic() < deadline, f"received {received}"
            received |= step(decode, set())[1]
            time.sleep(0.01)
        # The orphan's send ends (its lease runs out), but until the scheduler's finished ids
        # name it, get_finished keeps it back.
        while "orphan" not in prefill._done_sending:
            assert time.monotonic() < deadline, "the unclaimed send never ended"
            assert step(prefill, set()) == (set(), set())
            time.sleep(0.01)
        assert step(prefill, {"orphan"}) == ({"orphan"}, set())
        errors = decode.take_transfer_errors()
        assert set(errors) == {"missing", "bad"}
        assert errors["bad"].kind == "refused" and errors["bad"].failure_kind == "invalid", errors
        assert (errors["missing"].kind, errors["missing"].failure_kind) == ("failed", "timeout")
        assert decode.get_block_ids_with_load_errors() == {3, 4, NUM_BLOCKS, 1}
        (orphan,) = prefill.take_transfer_errors().values()
        assert (orphan.kind, orphan.failure_kind) == ("failed", "lease"), orphan
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_tp2_prefill_to_tp1_decode(plugin_dir, layout):
    """A prefill instance at TP 2 (each worker holds half the KV heads, one connector per
    worker, the same block ids on both, as vLLM's scheduler allocates) to a decode instance at
    TP 1. The scheduler side is rank 0's connector; a request is finished sending once both
    workers report it (vLLM's KVOutputAggregator)."""
    half = HEADS // 2
    ranks = [
        Engine(layout, "kv_first", fill=np.uint32(0), heads=half, head_offset=r * half)
        for r in range(2)
    ]
    dec_engine = Engine(layout, "kv_first", fill=CANARY)
    prefill = [
        connector("kv_producer", "prefill-tp2", plugin_dir, ranks[r], tp_size=2, tp_rank=r)
        for r in range(2)
    ]
    decode = connector("kv_consumer", "decode-tp1", plugin_dir, dec_engine)
    endpoints = [p.agent.endpoint() for p in prefill]
    prefill[0].config["endpoints"] = endpoints  # the deployment's list of the instance's ranks
    requests = [("tp-0", 45, True), ("tp-1", 16, False), ("tp-2", 70, False)]
    try:
        blocks = {}
        for i, (rid, n, scattered) in enumerate(requests):
            blocks[rid] = ranks[0].allocate(blocks_for(n + 1), scattered)
            for engine in ranks:
                engine.fill_prompt(i, blocks[rid], range(n))
            req = Request(rid, list(range(n)), {"do_remote_decode": True})
            delay_free, params = prefill[0].request_finished(req, blocks[rid])
            assert delay_free and params["remote_endpoints"] == endpoints
            dreq = Request(rid, list(range(n)), params)
            count, _ = decode.get_num_new_matched_tokens(dreq, 0)
            ids = dec_engine.allocate(blocks_for(n + 1), not scattered)
            decode.update_state_after_alloc(dreq, KVCacheBlocks(ids), count)
            blocks[rid, "decode"] = ids
        finished = {rid for rid, _, _ in requests}
        meta = prefill[0].build_connector_meta(None)  # broadcast to every worker
        for p in prefill:
            p.bind_connector_metadata(meta)
            p.start_load_kv(None)
            p.clear_connector_metadata()
        per_rank = [set(), set()]
        received, deadline = set(), time.monotonic() + 20
        while received != finished or per_rank != [finished, finished]:
            assert time.monotonic() < deadline, f"received {received}, sent {per_rank}"
            received |= step(decode, set())[1]
            for r, p in enumerate(prefill):
                per_rank[r] |= step(p, finished)[0]
            time.sleep(0.002)
        assert not decode.take_transfer_errors()
        assert not any(p.take_transfer_errors() for p in prefill)
    finally:
        for p in prefill:
            p.shutdown()
        decode.shutdown()
    for i, (rid, n, _) in enumerate(requests):
        ids = blocks[rid, "decode"]
        for t in range(n):
            for layer in range(LAYERS):
                for kv in range(2):
                    for h in range(HEADS):
                        got = dec_engine.row(layer, kv, ids[t // BLOCK], t % BLOCK, h)
                        want = pattern(layer, i, t, h, kv)
                        where = f"{rid} layer {layer} kv {kv} head {h} token {t}"
                        assert np.array_equal(got, want), where
    for b in set(range(NUM_BLOCKS)) - dec_engine.ever_used:
        for layer in range(LAYERS):
            for kv in range(2):
                assert np.all(dec_engine.block(layer, kv, b) == CANARY), f"block {b}"
