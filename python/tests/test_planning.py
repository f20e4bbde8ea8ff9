"""Plans without an agent (kvferry.PairPlanner): a TP-2 prefill instance and a TP-1 decode
rank described from numpy caches, each prefill rank's plan executed with plain memory copies
(as another transfer layer would move it), then every decode block checked: the request's
blocks hold their heads from the right prefill rank and slot, every other block its canary.
Then the refusals.
"""

from __future__ import annotations

import ctypes

import pytest

np = pytest.importorskip("numpy")

import kvferry  # noqa: E402
from kvferry.describe import agent_config, describe_paged_cache  # noqa: E402
from test_agent import plugin_dir  # noqa: E402,F401 (a fixture)

LAYERS, HEADS, HEAD, TPB, BLOCKS = 2, 8, 32, 16, 6
CANARY = 0x5A


def _config(role, instance, caches, tp, rank, plugins):
    desc = describe_paged_cache(
        caches,
        block_size=TPB,
        num_kv_heads=HEADS // tp,
        head_size=HEAD,
        tp_size=tp,
        tp_rank=rank,
    )
    return agent_config(
        instance=instance,
        role=role,
        architecture="LlamaForCausalLM",
        rank=desc,
        planner="kvferry.default",
        plugin_dir=plugins,
    )


def test_a_tp2_to_tp1_plan_executed_by_copies_delivers_every_block(plugin_dir):  # noqa: F811
    rng = np.random.default_rng(5)
    # [blocks, K|V, heads, tokens, head] per layer, fp16.
    prefill = [
        [
            rng.integers(0, 1 << 16, (BLOCKS, 2, HEADS // 2, TPB, HEAD), dtype=np.uint16).view(
                np.float16
            )
            for _ in range(LAYERS)
        ]
        for _ in range(2)
    ]
    decode = [
        np.full((BLOCKS, 2, HEADS, TPB, HEAD), CANARY * 0x0101, dtype=np.uint16).view(np.float16)
        for _ in range(LAYERS)
    ]
    decode_cfg = _config("generation", "decode", decode, 1, 0, plugin_dir)
    # 40 tokens: three blocks, the last partly filled.
    prompt_len = 40
    prefill_tables = [np.array([4, 0, 2], dtype=np.int32), np.array([1, 5, 3], dtype=np.int32)]
    decode_table = np.array([2, 5, 0], dtype=np.int32)
    moved = 0
    for r in range(2):
        planner = kvferry.PairPlanner(
            _config("context", "prefill", prefill[r], 2, r, plugin_dir), decode_cfg
        )
        assert planner.writes and planner.planner_id == "kvferry.default"
        plan = planner.plan([prefill_tables[r]], [decode_table], 0, prompt_len, prompt_len)
        fragments = plan.expand()
        assert len(fragments) == len(plan) == plan.fragments
        by_pattern = [
            (sr + so, dr + do, n)
            for frags, rows in plan.patterns()
            for sr, dr in rows
            for so, do, n in frags
        ]
        assert by_pattern == fragments
        assert plan.bytes == sum(n for _, _, n in fragments)
        for src, dst, n in fragments:
            ctypes.memmove(dst, src, n)
        moved += plan.bytes
    block = 2 * HEADS * TPB * HEAD * 2
    assert moved == LAYERS * 3 * block
    for layer in range(LAYERS):
        for ordinal, d in enumerate(decode_table):
            for r in range(2):
                got = decode[layer][d, :, r * HEADS // 2 : (r + 1) * HEADS // 2]
                want = prefill[r][layer][prefill_tables[r][ordinal]]
                assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), (layer, ordinal, r)
        untouched = [b for b in range(BLOCKS) if b not in decode_table]
        raw = decode[layer][untouched].view(np.uint8)
        assert (raw == CANARY).all(), f"layer {layer}: a block the request does not hold changed"


def test_refusals_name_what_is_wrong(plugin_dir):  # noqa: F811
    caches = [np.zeros((BLOCKS, 2, HEADS, TPB, HEAD), dtype=np.float16) for _ in range(LAYERS)]
    prefill = _config("context", "prefill", caches, 1, 0, plugin_dir)
    decode = _config("generation", "decode", caches, 1, 0, plugin_dir)
    with pytest.raises(kvferry.Error, match="prefill configuration's role is decode") as e:
        kvferry.PairPlanner(decode, prefill)
    assert e.value.kind == "invalid"
    with pytest.raises(kvferry.Error, match='config has no "version"') as e:
        kvferry.PairPlanner("{}", decode)
    assert e.value.kind == "config"
    planner = kvferry.PairPlanner(prefill, decode)
    table = np.array([0], dtype=np.int32)
    with pytest.raises(kvferry.Error, match=r"the decode side: 2 slot table\(s\) for 1 layer group") as e:
        planner.plan([table], [table, table], 0, 16, 16)
    assert e.value.kind == "invalid"
    with pytest.raises(kvferry.Error, match="the prefill side.*slot 6") as e:
        planner.plan([np.array([6], dtype=np.int32)], [table], 0, 16, 16)
    assert e.value.kind == "invalid"
    # Tables short of the tokens: 40 tokens of 16-token blocks need three
    # entries; two used to plan 32 tokens as if they were the request.
    two, three = np.array([0, 1], dtype=np.int32), np.array([0, 1, 2], dtype=np.int32)
    for p, d, side in [(two, three, "prefill"), (three, two, "decode")]:
        with pytest.raises(kvferry.Error, match=f"the {side} side.*2 entries of 16 tokens") as e:
            planner.plan([p], [d], 0, 40, 40)
        assert e.value.kind == "invalid" and "run to 40" in str(e.value)
    with pytest.raises(kvferry.Error, match="slot 1 is named for blocks 1 and 2"):
        planner.plan([three], [np.array([0, 1, 1], dtype=np.int32)], 0, 40, 40)
    with pytest.raises(kvferry.Error, match=r"view \(group 0, view 9\) is not a view"):
        planner.plan([table], [table], 0, 16, 16, views=[(0, 9)])
    with pytest.raises(TypeError, match="int32"):
        planner.plan([np.array([0], dtype=np.int64)], [table], 0, 16, 16)
