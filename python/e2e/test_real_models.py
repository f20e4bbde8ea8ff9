"""Real-model end to end: a prefill engine's KV cache, moved by kvferry, decodes exactly as the
prefill engine itself would have.

Each case builds a tiny, randomly initialised Hugging Face model (fixed seed, float32, CPU) and
simulates a disaggregated deployment honestly (``paged_engine.py``):

1. A **prefill instance at TP 2** (two ranks, one ``kvferry.Agent`` each, all in this
   process) runs the real model over the prompt — in one forward, or chunk by chunk for a
   chunked send — and each rank writes *its* KV heads of every layer (and its share of the
   recurrent state) into its own paged pools, laid out as its page table declares: HND
   ``[head][token][dim]`` or NHD ``[token][head][dim]`` blocks at scattered block ids.
2. A **decode instance** (TP 1, TP 4, or TP 2 with PP 2) posts ``expect`` on every rank into
   blocks of its own allocator; the prefill ranks ``send`` (one call, or one per chunk with
   token ranges, the last ``is_last``); ``kvferry.default`` plans the head re-sharding and
   PP split, and the agents move the bytes over shared memory.
3. Each decode rank's pools are read back, alone, and the decode engine assembles the
   model's cache (``transformers.DynamicCache``) from them, then greedily generates
   ``STEPS`` tokens from the prefill's first token.
4. The **co-located run** is the prefill engine continuing from its own cache. Tokens must be
   identical and every step's logits equal within ``ATOL``/``RTOL`` (float32). Transferred
   caches match to the bit (logit difference 0); the tolerance is for a decode-side cached
   prefix, which the decode computed itself over fewer tokens (Qwen3-Next: 1.4e-6, its chunked
   delta rule rounds differently over another length; Llama: 0).

Pools start as NaN, so a byte kvferry should have written and did not turns the decode's
logits into NaN; a byte written to the wrong head or token changes them.

Models: ``LlamaForCausalLM`` (grouped-query attention, 4 layers, 8 query heads, 4 KV heads of
32); ``Qwen3NextForCausalLM`` (hybrid: full attention and Gated DeltaNet layers, whose conv
and recurrent state travel as a STATE layer group — transformers' reference PyTorch path,
without ``flash-linear-attention`` or ``causal-conv1d``); ``GptOssForCausalLM`` (sliding-window
layers, whose blocks before the window are holes in the slot table on both sides).

**DeepSeek-V3's MLA is not covered here.** transformers' ``DeepseekV3ForCausalLM`` caches the
decompressed per-head K and V (``num_heads × (qk_nope + qk_rope)`` and ``num_heads × v_head``
per token), not the 576-element latent (``kv_lora_rank`` 512 + rope 64) that serving engines
store and that ``kvferry.deepseek_mla_latent`` and the default planner move for it. Moving
its per-head cache would exercise the GQA path again (already proven above), not the latent
layout; rebuilding the latent from the model would mean re-implementing its attention. The
latent path is proven by the oracle instead: ``kvferry conform`` and ``kvferry plan --verify
--model deepseek-v3`` check every destination byte of tagged latent pools.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# Outside scripts/e2e-model's venv (e.g. `pytest python` in target/py-venv) there is no torch:
# skip rather than fail collection.
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from paged_engine import Instance, ModelGeometry, Topology, wait_all  # noqa: E402

STEPS = 32
TPB = 16
ATOL = RTOL = 1e-5
PREFILL = Topology(tp=2)
TRANSPORT = os.environ.get("KVFERRY_E2E_TRANSPORT", "shm")
REPO = Path(__file__).resolve().parents[2]
_request_ids = itertools.count(1000)
#: One line per passed case, printed after the run (conftest.py).
RESULTS: list[str] = []

torch.use_deterministic_algorithms(True)


# ---------------------------------------------------------------------------------------------
# The models: tiny, random, deterministic.


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM, LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=512,
        initializer_range=0.1,
        architectures=["LlamaForCausalLM"],
    )


def _qwen3_next() -> Any:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    return Qwen3NextForCausalLM, Qwen3NextConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        max_position_embeddings=512,
        initializer_range=0.1,
        architectures=["Qwen3NextForCausalLM"],
    )


def _gpt_oss() -> Any:
    from transformers import GptOssConfig, GptOssForCausalLM

    return GptOssForCausalLM, GptOssConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        sliding_window=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        initializer_range=0.1,
        architectures=["GptOssForCausalLM"],
    )


BUILDERS = {"llama": _llama, "qwen3_next": _qwen3_next, "gpt_oss": _gpt_oss}
_models: dict[str, Any] = {}


def model_of(name: str) -> Any:
    if name not in _models:
        cls, config = BUILDERS[name]()
        torch.manual_seed(0)
        _models[name] = cls(config).eval()
    return _models[name]


# ---------------------------------------------------------------------------------------------
# The cases.


@dataclass(frozen=True)
class Case:
    model: str
    decode: Topology
    layout: str = "hnd"
    prompt_len: int = 45
    #: Token boundaries of a chunked prefill and send (each a multiple of TPB); () = one.
    chunks: tuple[int, ...] = ()
    #: Tokens the decode side already holds (block-aligned), computed by the decode itself.
    cached_prefix: int = 0
    decode_tpb: int = TPB

    @property
    def id(self) -> str:
        parts = [self.model, self.layout, self.decode.mapping, f"len{self.prompt_len}"]
        if self.chunks:
            parts.append("chunks" + "+".join(map(str, self.chunks)))
        if self.cached_prefix:
            parts.append(f"cached{self.cached_prefix}")
        if self.decode_tpb != TPB:
            parts.append(f"tpb{TPB}to{self.decode_tpb}")
        return "-".join(parts)


TP1, TP4, TP2PP2 = Topology(1), Topology(4), Topology(2, 2)
CASES = [
    # Llama GQA: every decode topology in both layouts; prompts end mid-block.
    *(Case("llama", topo, layout) for layout in ("hnd", "nhd") for topo in (TP1, TP4, TP2PP2)),
    # A chunked prefill sent as it is computed: 32 + 32 + 13 tokens, three sends.
    Case("llama", TP4, "hnd", 77, chunks=(32, 64)),
    Case("llama", TP2PP2, "nhd", 77, chunks=(32, 64)),
    # The decode already holds the first two blocks (a prefix-cache hit).
    Case("llama", TP1, "hnd", 61, cached_prefix=32),
    Case("llama", TP4, "nhd", 61, cached_prefix=32),
    # Different block sizes: the planner re-blocks HND 16-token blocks into 32-token ones.
    Case("llama", TP1, "hnd", 45, decode_tpb=32),
    # Hybrid: full attention in PAGED blocks, Gated DeltaNet conv + recurrent state in STATE.
    *(Case("qwen3_next", topo) for topo in (TP1, TP4, TP2PP2)),
    Case("qwen3_next", TP4, "nhd", 77, chunks=(32, 64)),
    # A prefix-cache hit on the decode: its blocks stay, the whole recurrent state arrives.
    Case("qwen3_next", TP1, "hnd", 61, cached_prefix=32),
    # Sliding-window layers alternating with full attention.
    *(Case("gpt_oss", topo) for topo in (TP1, TP4, TP2PP2)),
    Case("gpt_oss", TP2PP2, "nhd", 53),
    # Chunked: the first chunk holds no block of the final window, the second one block.
    Case("gpt_oss", TP4, "hnd", 77, chunks=(32, 64)),
]


@pytest.fixture(scope="session")
def plugin_dir(tmp_path_factory) -> str:
    """A plugin directory holding the default planner: ``KVFERRY_E2E_PLANNER`` (the .so
    scripts/e2e-model just built), else the newest in the checkout's target/."""
    named = os.environ.get("KVFERRY_E2E_PLANNER")
    if named:
        candidates = [Path(named)]
    else:
        candidates = [
            REPO / "target" / profile / "libkvferry_planner_default.so"
            for profile in ("debug", "release")
        ]
    candidates = [c for c in candidates if c.exists()]
    if not candidates:
        pytest.fail(
            "no libkvferry_planner_default.so: run `cargo build -p kvferry-planner-default` "
            "or set KVFERRY_E2E_PLANNER"
        )
    newest = max(candidates, key=lambda c: c.stat().st_mtime)
    # A directory of its own: every .so in a plugin directory is loaded.
    out = tmp_path_factory.mktemp("planners")
    shutil.copy(newest, out / newest.name)
    return str(out)


@torch.no_grad()
def greedy(model: Any, cache: Any, first_token: int, steps: int) -> tuple[list[int], torch.Tensor]:
    """``steps`` greedy decode steps from ``cache``, feeding ``first_token`` first: the
    tokens chosen and every step's logits."""
    tokens: list[int] = []
    logits = []
    token = torch.tensor([[first_token]])
    for _ in range(steps):
        out = model(input_ids=token, cache=cache, use_cache=True)
        step = out.logits[0, -1]
        logits.append(step)
        token = step.argmax().view(1, 1)
        tokens.append(int(token))
    return tokens, torch.stack(logits)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_decode_from_transferred_cache_matches_colocated(case: Case, plugin_dir: str) -> None:
    model = model_of(case.model)
    geometry = ModelGeometry.of(model.config)
    length = case.prompt_len
    generator = torch.Generator().manual_seed(length)
    prompt = torch.randint(0, model.config.vocab_size, (1, length), generator=generator)
    bounds = [0, *case.chunks, length]
    assert all(b % TPB == 0 for b in bounds[1:-1]), "chunks must end on block boundaries"

    prefill = Instance(
        "prefill",
        "context",
        geometry,
        PREFILL,
        tokens_per_block=TPB,
        layout=case.layout,
        num_blocks=24,
        seed=1,
    )
    decode = Instance(
        "decode",
        "generation",
        geometry,
        case.decode,
        tokens_per_block=case.decode_tpb,
        layout=case.layout,
        num_blocks=20,
        seed=2,
        pad_elems=16,
    )
    prefill.start(plugin_dir, TRANSPORT)
    try:
        decode.start(plugin_dir, TRANSPORT)
        try:
            tokens, logits, reference, ref_logits, mismatch = _run(
                case, model, geometry, prompt, bounds, prefill, decode
            )
        finally:
            decode.close()
    finally:
        prefill.close()

    where = f"cache entries of the decode that differ from the prefill's:\n{mismatch}"
    nan_steps = torch.isnan(logits).any(dim=1).nonzero().flatten().tolist()
    assert not nan_steps, (
        f"{case.id}: NaN logits from step {nan_steps[0]} on: cache bytes never arrived; {where}"
    )
    first_diff = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)
    assert tokens == reference, (
        f"{case.id}: greedy tokens differ from the co-located run at step {first_diff}:\n"
        f"  decode    {tokens}\n  colocated {reference}\n{where}"
    )
    diff = (logits - ref_logits).abs().max().item()
    torch.testing.assert_close(
        logits,
        ref_logits,
        atol=ATOL,
        rtol=RTOL,
        msg=lambda m: (
            f"{case.id}: logits differ from the co-located run (max |diff| {diff:.3g}): "
            f"{m}\n{where}"
        ),
    )
    RESULTS.append(f"{case.id}: {STEPS} greedy tokens identical, max |logit diff| {diff:.3g}")


def mismatch_report(got: Any, want: Any, geometry: ModelGeometry) -> str:
    """Which layers, tensors and heads (channels, for the conv state) of the decode's
    assembled cache differ from the prefill's own: the failure's diagnosis."""
    lines = []
    for layer, kind in enumerate(geometry.layer_kinds):
        a, b = got.layers[layer], want.layers[layer]
        if kind == "linear":
            pairs = [
                ("conv state", a.conv_states[0], b.conv_states[0]),
                ("recurrent state", a.recurrent_states[0], b.recurrent_states[0]),
            ]
        else:
            pairs = [("K", a.keys, b.keys), ("V", a.values, b.values)]
        for name, x, y in pairs:
            if x.shape != y.shape:
                lines.append(
                    f"  layer {layer} {name}: shape {tuple(x.shape)}, want {tuple(y.shape)}"
                )
                continue
            bad = ~torch.isclose(x, y, atol=ATOL, rtol=RTOL)
            if bad.any():
                rows = sorted(set(bad.nonzero()[:, 1].tolist()))
                unit = "channels" if name == "conv state" else "heads"
                nan = " (NaN: never written)" if torch.isnan(x).any() else ""
                lines.append(
                    f"  layer {layer} {name}: {int(bad.sum())} of {bad.numel()} values, "
                    f"{unit} {rows[0]}..{rows[-1]} ({len(rows)} of {x.shape[1]}){nan}"
                )
    return "\n".join(lines) or "  none"


def expected_bytes(case: Case, geometry: ModelGeometry, rank: Any, length: int) -> int:
    """The bytes a decode rank's pools receive: for every PAGED group, its heads of every
    token slot of the blocks past the cached prefix (and the sliding window's holes), in units
    of the smaller side's blocks; for a STATE group, its whole share of every layer's state."""
    small = min(TPB, case.decode_tpb)
    total = 0
    for g in rank.paged:
        start = case.cached_prefix
        if g.kind == "sliding":
            start = max(start, geometry.held_positions("sliding", length).start // TPB * TPB)
        blocks = math.ceil(length / small) - start // small
        total += blocks * small * 2 * g.heads.count * geometry.head_dim * 4 * len(g.layers)
    if rank.state:
        total += 4 * (rank.state.conv.slot_elems + rank.state.ssm.slot_elems)
    return total


def _run(case, model, geometry, prompt, bounds, prefill, decode):
    length = prompt.shape[1]
    rid = next(_request_ids)

    # The decode engine: its blocks, its own cached prefix if any, then expect on every rank.
    dreq = decode.allocate(length)
    if case.cached_prefix:
        with torch.no_grad():
            hit = model(input_ids=prompt[:, : case.cached_prefix], use_cache=True).cache
        decode.store(dreq, hit, range(0, case.cached_prefix), length, state=False)
    endpoints = prefill.endpoints()
    for rank, agent in zip(decode.ranks, decode.agents):
        agent.expect(
            rid,
            prefill.name,
            endpoints,
            0,
            length,
            decode.tables(rank, dreq, length, length),
            cached_prefix=case.cached_prefix or None,
        )

    # The prefill engine: compute each chunk, store it, send it.
    preq = prefill.allocate(length)
    cache = None
    with torch.no_grad():
        for lo, hi in zip(bounds, bounds[1:]):
            out = model(input_ids=prompt[:, lo:hi], cache=cache, use_cache=True)
            cache = out.cache
            last = hi == length
            prefill.store(preq, cache, range(lo, hi), length, state=last)
            for rank, agent in zip(prefill.ranks, prefill.agents):
                agent.send(
                    rid,
                    prefill.tables(rank, preq, hi, length, state=last),
                    lo,
                    hi,
                    length,
                    last,
                    to=decode.name,
                )
    first_token = int(out.logits[0, -1].argmax())

    sent = wait_all(prefill.agents, rid)
    received = wait_all(decode.agents, rid)
    assert all(e.kind == "sent" for e in sent), (sent, received)
    assert all(e.kind == "received" for e in received), received
    # Exactly the rank's share of the blocks not cached here (and of the state) arrived.
    want = [expected_bytes(case, geometry, rank, length) for rank in decode.ranks]
    assert [e.bytes for e in received] == want, (received, want)
    assert sum(e.bytes for e in sent) == sum(want), sent

    # Decode: the cache from the decode ranks' pools alone, then STEPS greedy tokens.
    rebuilt = decode.assemble(dreq, length, model.config)
    mismatch = mismatch_report(rebuilt, cache, geometry)
    tokens, logits = greedy(model, rebuilt, first_token, STEPS)
    # Co-located: the prefill engine goes on from its own cache.
    reference, ref_logits = greedy(model, cache, first_token, STEPS)
    return tokens, logits, reference, ref_logits, mismatch
