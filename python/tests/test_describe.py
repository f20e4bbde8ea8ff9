"""Agents configured from the cache tensors themselves (kvferry.describe): a prefill cache
and a decode cache shaped differently — one tensor per layer with K and V split in each
block on one side, a (key, value) pair of tensors per layer with more blocks on the other —
described by describe_paged_cache, moved by two agents, and every byte of the decode cache
checked: received blocks equal their source, every other block keeps its canary. Once over
numpy arrays, once over torch CPU tensors (bf16) when torch is installed; then every
refusal names what is wrong.
"""

from __future__ import annotations

import pytest

np = pytest.importorskip("numpy")

import kvferry  # noqa: E402
from kvferry.describe import (  # noqa: E402
    agent_config,
    describe_paged_cache,
    pool,
    pool_from_pointer,
)
from test_agent import SECRET, plugin_dir, wait  # noqa: E402,F401 (plugin_dir: a fixture)

LAYERS, HEADS, HEAD, TPB = 3, 2, 32, 16
PREFILL_BLOCKS, DECODE_BLOCKS = 8, 12
CANARY = 0x5A


def _bytes(t):
    """A tensor's bytes as a flat numpy uint8 view (torch through its storage)."""
    if hasattr(t, "numpy"):
        import torch

        return t.contiguous().view(torch.uint8).numpy().reshape(-1)
    return np.ascontiguousarray(t).view(np.uint8).reshape(-1)


def _new(lib, shape, fill=None, seed=0):
    """A bf16 (torch) or fp16 (numpy) tensor of `shape`: random bytes, or every byte `fill`."""
    if lib == "torch":
        torch = pytest.importorskip("torch")
        t = torch.empty(shape, dtype=torch.bfloat16)
        raw = t.view(torch.uint8)
        if fill is None:
            gen = torch.Generator().manual_seed(seed)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        else:
            raw.fill_(fill)
        return t
    if fill is None:
        rng = np.random.default_rng(seed)
        return rng.integers(0, 1 << 16, shape, dtype=np.uint16).view(np.float16)
    return np.full(shape, fill * 0x0101, dtype=np.uint16).view(np.float16)


def make_caches(lib, form):
    """The prefill cache (a pattern) and the decode cache (the canary), both in `form`: one
    tensor per layer with K and V split in each block, or a (key, value) pair per layer. The
    decode side has more blocks, and its blocks lie every other one in a bigger tensor."""
    interior = (HEADS, TPB, HEAD)
    if form == "split":
        prefill = [_new(lib, (PREFILL_BLOCKS, 2, *interior), seed=l) for l in range(LAYERS)]
        whole = [_new(lib, (2 * DECODE_BLOCKS, 2, *interior), fill=CANARY) for _ in range(LAYERS)]
        decode = [t[::2] for t in whole]
    else:
        prefill = [
            tuple(_new(lib, (PREFILL_BLOCKS, *interior), seed=2 * l + r) for r in range(2))
            for l in range(LAYERS)
        ]
        whole = [_new(lib, (2 * DECODE_BLOCKS, *interior), fill=CANARY) for _ in range(2 * LAYERS)]
        decode = [(whole[2 * l][::2], whole[2 * l + 1][::2]) for l in range(LAYERS)]
    return prefill, decode, whole


def _role_block(cache, form, layer, role, block):
    """The bytes of one role of one block of a layer."""
    t = cache[layer][block, role] if form == "split" else cache[layer][role][block]
    return _bytes(t)


def _tensors(cache, form):
    return list(cache) if form == "split" else [t for pair in cache for t in pair]


@pytest.mark.parametrize("form", ["split", "pairs"])
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_described_caches_move_every_byte(plugin_dir, lib, form):  # noqa: F811
    prefill, decode, whole = make_caches(lib, form)
    shape = {"block_size": TPB, "num_kv_heads": HEADS, "head_size": HEAD}
    common = {
        "architecture": "LlamaForCausalLM",
        "planner": "kvferry.default",
        "plugin_dir": plugin_dir,
        "transport": "tcp",
        "listen": "127.0.0.1:0",
        "secret": SECRET,
    }
    ctx = kvferry.Agent(
        agent_config(instance="prefill-d", role="context",
                     rank=describe_paged_cache(prefill, **shape), **common),
        keep_alive=_tensors(prefill, form),
    )
    gen = kvferry.Agent(
        agent_config(instance="decode-d", role="generation",
                     rank=describe_paged_cache(decode, **shape), **common),
        keep_alive=_tensors(decode, form),
    )
    with ctx, gen:
        src_slots, dst_slots = [6, 1, 3], [10, 0, 7]
        tokens = len(src_slots) * TPB
        ctx.send(1, [np.array(src_slots, dtype=np.int32)], 0, tokens, tokens, True)
        gen.expect(1, "prefill-d", [ctx.endpoint()], 0, tokens,
                   [np.array(dst_slots, dtype=np.int32)])
        sent, received = wait([ctx, gen], 1)
        assert sent[1].kind == "sent", repr(sent[1])
        assert received[1].kind == "received", repr(received[1])
    block = HEADS * TPB * HEAD * 2  # one role of one block, in bytes (fp16 or bf16)
    assert received[1].bytes == LAYERS * 2 * len(src_slots) * block
    for layer in range(LAYERS):
        for role in range(2):
            for s, d in zip(src_slots, dst_slots):
                got = _role_block(decode, form, layer, role, d)
                assert np.array_equal(got, _role_block(prefill, form, layer, role, s)), (
                    layer, role, s, d)
            for b in set(range(DECODE_BLOCKS)) - set(dst_slots):
                assert np.all(_role_block(decode, form, layer, role, b) == CANARY), (
                    layer, role, b)
    # Nor did the bytes between the decode side's blocks change.
    for t in whole:
        assert np.all(_bytes(t[1::2]) == CANARY)


def test_refusals_name_what_is_wrong():
    shape = {"block_size": TPB, "num_kv_heads": HEADS, "head_size": HEAD}
    good = np.zeros((4, 2, HEADS, TPB, HEAD), dtype=np.float16)

    def refused(match, *args, **kwargs):
        with pytest.raises(ValueError, match=match):
            describe_paged_cache(*args, **kwargs)

    refused(r"layer 1: shape \(4, 2, 2, 16, 16\), expected \(blocks, 2, 2, 16, 32\)",
            [good, np.zeros((4, 2, HEADS, TPB, 16), dtype=np.float16)], **shape)
    refused(r"layer 1: 4 blocks of float32 on cpu; the first layer has 4 of float16",
            [good, good.astype(np.float32)], **shape)
    # Every other head of a bigger array: the block interior is strided.
    wide = np.zeros((4, 2, HEADS * 2, TPB, HEAD), dtype=np.float16)[:, :, ::2]
    refused(r"layer 0: dimensions 1.. of shape .* are not contiguous", [wide], **shape)
    refused(r"dtype int16 is not one kvferry describes",
            [np.zeros((4, 2, HEADS, TPB, HEAD), dtype=np.int16)], **shape)
    refused(r"2 KV heads on this rank do not shard 6 over TP 2",
            [good], tp_size=2, total_kv_heads=6, **shape)
    refused(r'layout must be "hnd" or "nhd"', [good], layout="bhnd", **shape)
    refused(r"every layer a \(key, value\) pair, or every layer one tensor",
            [good, (good[:, 0], good[:, 1])], **shape)
    with pytest.raises(TypeError, match="layer 0: a torch tensor or a numpy array, not str"):
        describe_paged_cache(["not a tensor"], kv="fused", **shape)
    with pytest.raises(ValueError, match=r"layer 0: a \(key, value\) pair, not 3 tensors"):
        describe_paged_cache([(good, good, good)], **shape)


def test_pools_from_arrays_and_pointers():
    a = np.zeros((5, 64), dtype=np.uint8)
    p = pool(a)
    assert p == {"base": a.ctypes.data, "slot_bytes": 64, "slot_stride": 64, "num_slots": 5,
                 "memory_type": "dram"}
    # Every other row: a stride bigger than the slot.
    p = pool(a[::2])
    assert (p["slot_bytes"], p["slot_stride"], p["num_slots"]) == (64, 128, 3)
    assert pool_from_pointer(0x1000, 256, 8, cuda_device=1)["memory_type"] == "vram"
    with pytest.raises(ValueError, match="slot_stride 128 is smaller than slot_bytes 256"):
        pool_from_pointer(0x1000, 256, 8, slot_stride=128)
    with pytest.raises(ValueError, match="base must be a non-null address"):
        pool_from_pointer(0, 256, 8)


def test_tensor_parallel_sharding_and_replicas():
    shape = {"block_size": TPB, "num_kv_heads": 1, "head_size": HEAD}
    caches = [np.zeros((4, TPB, 1, HEAD * 2), dtype=np.float16)]
    # 2 KV heads over TP 4: each head on two ranks; rank 3 holds head 1, second replica.
    rank = describe_paged_cache(caches, layout="nhd", kv="fused", tp_size=4, tp_rank=3,
                                total_kv_heads=2, **shape)
    layout = rank["page_table"]["groups"][0]["views"][0]["layout"]
    assert (layout["num_shards"], layout["shard_index"]) == (2, 1)
    assert (layout["num_replicas"], layout["replica_index"]) == (2, 1)
    assert layout["kind"] == "nhd" and layout["shard_unit_bytes"] == 2 * HEAD * 2
    assert rank["mapping"] == "tp4" and rank["instance_rank"] == 3
    assert rank.cuda_device is None


def test_fused_caches_with_a_narrower_value_head_and_named_layers():
    # vLLM's CPU cache: [block, head, token, K|V], V narrower than K here.
    caches = [np.zeros((4, HEADS, TPB, HEAD + 16), dtype=np.float16) for _ in range(2)]
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    shape = {"block_size": TPB, "num_kv_heads": HEADS, "head_size": HEAD}
    rank = describe_paged_cache(caches, kv="fused", value_head_size=16, layers=[0, 1],
                                names=names, **shape)
    view = rank["page_table"]["groups"][0]["views"][1]
    assert view["entries"] == [{"local_layer": 1, "offset": 0,
                                "size": HEADS * TPB * (HEAD + 16) * 2}]
    assert view["layout"]["shard_unit_bytes"] == TPB * (HEAD + 16) * 2
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.attn: shape"):
        describe_paged_cache([caches[0], caches[1][:, :, :, :HEAD]], kv="fused",
                             value_head_size=16, names=names, **shape)
    with pytest.raises(ValueError, match='value_head_size 16 differs from head_size 32: kv="fused" only'):
        describe_paged_cache(caches, kv="split", value_head_size=16, **shape)
