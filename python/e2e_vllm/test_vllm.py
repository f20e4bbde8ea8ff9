"""kvferry inside real vLLM (the CPU build): a prefill instance and a decode instance, each its
own vLLM with ``kvferry.vllm.KvferryConnector`` loaded by module path, must produce exactly the
greedy tokens of one co-located vLLM, and the decode instance must have computed no prompt
token (vLLM's own ``vllm:prompt_tokens_by_source``: every one loaded or a local prefix-cache
hit; vLLM counts at admission, before it replays the last prompt token to sample the next).

Models: tiny random GQA models (``models.py``): Llama (4 layers) and Qwen3 (3 layers, q/k
norms, tied embeddings), 2 KV heads of 64, blocks of 32 tokens. TP pairs 1 -> 1, 2 -> 1 and
1 -> 2 (the planner re-shards KV heads); blocks of 64 tokens on both sides; PP 2 -> TP 1,
PP 2 -> TP 2 and TP 1 -> PP 2 (each stage's workers send or load their own layers); and
blocks of 32 on one side and 64 on the other, which vLLM's CPU cache cannot be re-blocked
for: the decode prefills those prompts itself. Prompts in two waves: the second shares
prefixes with the first, so the decode instance meets them in its own prefix cache and loads
only the rest (``cached_prefix``), and the prefill instance reuses its own cached blocks.

Run by ``scripts/e2e-vllm`` (its venv, the planner, the package); each case prints its time.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import models  # noqa: E402

MAX_TOKENS = 12
SECRET = "kvferry vllm end-to-end secret"
TIMEOUT_S = 900


def _words(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(models.WORDS) for _ in range(n)]


def _prompts() -> list[list[str]]:
    """Two waves of prompts (as text; every word is one token)."""
    rng = random.Random(7)
    base = {n: _words(rng, n) for n in (5, 31, 32, 33, 45, 64, 96, 100, 150, 1000)}
    wave1 = [" ".join(base[n]) for n in sorted(base)]
    wave2 = [
        " ".join(base[32] + _words(rng, 32)),  # a one-block hit, then an exact multiple
        " ".join(base[64] + _words(rng, 1)),  # a two-block hit, then one token
        " ".join(base[96] + _words(rng, 20)),  # three blocks hit, ends mid-block
        " ".join(base[45] + _words(rng, 40)),  # one block hit (45 is not block-aligned)
        " ".join(base[100][:70] + _words(rng, 3)),  # two blocks of a longer prompt
        " ".join(_words(rng, 7)),
        " ".join(_words(rng, 63)),
        " ".join(_words(rng, 128)),
    ]
    return [wave1, wave2]


WAVES = _prompts()


def _run(spec: dict, path: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    path.write_text(json.dumps(spec))
    return subprocess.Popen(
        [sys.executable, str(HERE / "instance.py"), str(path)],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
    )


def _wait(proc: subprocess.Popen, name: str, log: Path, timeout: float = TIMEOUT_S) -> None:
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = "killed after timeout"
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        pytest.fail(f"{name} exited {code}; the end of {log}:\n{tail}")


def _run_pair(prefill: dict, decode: dict, tmp: Path, env: dict[str, str]) -> dict:
    """Runs a prefill and a decode instance to the decode's end (then releases the prefill);
    returns what the decode wrote."""
    plog, dlog = tmp / "prefill.log", tmp / "decode.log"
    p = _run(prefill, tmp / "prefill.spec", env, plog)
    d = _run(decode, tmp / "decode.spec", env, dlog)
    try:
        _wait(d, "decode", dlog)
    finally:
        Path(prefill["release"]).touch()
        if d.poll() is None:
            d.kill()
    _wait(p, "prefill", plog, timeout=120)
    return json.loads(Path(decode["out"]).read_text())


def connector_config(env: dict[str, str]) -> dict:
    """The ``kv_connector_extra_config`` every instance here shares."""
    return {
        "plugin_dir": env["KVFERRY_E2E_PLUGIN_DIR"],
        "secret": SECRET,
        "listen": "127.0.0.1:0",
        "advertise": "127.0.0.1",
        "transport": os.environ.get("KVFERRY_E2E_TRANSPORT", "tcp"),
        # Two vLLM instances oversubscribe this 2-core machine (each engine core and worker
        # spins between steps, OMP threads spin in forward passes): kvferry's threads went
        # unscheduled for seconds (a keep-alive 6.9 s late, measured), and the default 10 s
        # cut healthy links; for the same reason both decode workers' first handshakes with a
        # prefill rank (TP 1 -> 2 over the server) once ran past the default 5 s.
        "peer_timeout_ms": 30000,
        "handshake_timeout_ms": 30000,
    }


_COLOCATED: dict[str, list] = {}


def colocated(
    name: str, root: Path, tmp: Path, env: dict[str, str], block_size: int = 32
) -> list:
    """The co-located instance's tokens for model ``name`` at TP 1 with blocks of
    ``block_size`` tokens (computed once)."""
    key = f"{name}-bs{block_size}"
    if key not in _COLOCATED:
        model, tokenizer = models.make(root, name)
        spec = {
            "role": "colocated",
            "model": str(model),
            "tokenizer": str(tokenizer),
            "tp": 1,
            "block_size": block_size,
            "waves": WAVES,
            "max_tokens": MAX_TOKENS,
            "out": str(tmp / f"{key}-colocated.json"),
        }
        log = tmp / f"{key}-colocated.log"
        _wait(_run(spec, tmp / f"{key}-colocated.spec", env, log), "colocated", log)
        _COLOCATED[key] = json.loads(Path(spec["out"]).read_text())["outputs"]
    return _COLOCATED[key]


def _shape(spec: dict) -> str:
    """An instance's parallelism and block size, for the report line."""
    text = f"TP {spec['tp']}" + (f" PP {spec['pp']}" if spec.get("pp", 1) > 1 else "")
    return text + f", blocks of {spec.get('block_size', 32)}"


def _disaggregate(
    name: str,
    prefill_shape: dict,
    decode_shape: dict,
    env: dict[str, str],
    model_root: Path,
    tmp_path: Path,
) -> tuple[dict, dict, dict]:
    """Runs ``WAVES`` through a prefill instance of ``prefill_shape`` (``tp``, and ``pp``,
    ``block_size`` if given) and a decode instance of ``decode_shape``; returns what the
    decode wrote and the two instances' specs."""
    model, tokenizer = models.make(model_root, name)
    extra = connector_config(env)
    common = {"model": str(model), "tokenizer": str(tokenizer), "waves": WAVES}
    prefill = {
        **common,
        **prefill_shape,
        "role": "prefill",
        "extra": {**extra, "instance": f"prefill-{name}"},
        "out": str(tmp_path / "params.json"),
        "out_after": str(tmp_path / "prefill-after.json"),
        "release": str(tmp_path / "release"),
    }
    decode = {
        **common,
        **decode_shape,
        "role": "decode",
        "max_tokens": MAX_TOKENS,
        "extra": {**extra, "instance": f"decode-{name}"},
        "params": prefill["out"],
        "out": str(tmp_path / "decode.json"),
    }
    return _run_pair(prefill, decode, tmp_path, env), prefill, decode


def _assert_tokens(want: list, got: dict) -> None:
    """Every prompt's tokens are the co-located instance's."""
    for w, (want_wave, got_wave) in enumerate(zip(want, got["outputs"], strict=True)):
        for i, (a, b) in enumerate(zip(want_wave, got_wave, strict=True)):
            assert b["tokens"] == a["tokens"], (
                f"wave {w} prompt {i} ({a['prompt_tokens']} tokens): decode gave {b['tokens']}, "
                f"co-located {a['tokens']}"
            )


def _sources(got: dict) -> tuple[float | None, float | None, float, int]:
    """vLLM's counts of the decode's prompt tokens: (computed, loaded, prefix-cache hits,
    total)."""
    metrics = got["metrics"]
    return (
        metrics.get("vllm:prompt_tokens_by_source{source=local_compute}"),
        metrics.get("vllm:prompt_tokens_by_source{source=external_kv_transfer}"),
        metrics.get("vllm:prompt_tokens_by_source{source=local_cache_hit}", 0),
        sum(o["prompt_tokens"] for wave in got["outputs"] for o in wave),
    )


def _layer_parts(prefill: dict) -> float:
    """The layer-wise sends the prefill instance's workers made."""
    sent = json.loads(Path(prefill["out"]).read_text())["metrics"]
    return sum(v for k, v in sent.items() if k.startswith("vllm:kvferry_layer_parts"))


def _disaggregated_equals_colocated(
    name: str,
    prefill_shape: dict,
    decode_shape: dict,
    env: dict[str, str],
    model_root: Path,
    tmp_path: Path,
) -> None:
    """Runs ``WAVES`` through a prefill and a decode instance (:func:`_disaggregate`) and
    asserts: every prompt's tokens are the co-located instance's (TP 1, at the decode's block
    size), the decode computed no prompt token, the second wave met the first in the decode's
    prefix cache, and every prefill worker sent every prompt layer by layer."""
    t0 = time.monotonic()
    want = colocated(name, model_root, tmp_path, env, decode_shape.get("block_size", 32))
    got, prefill, decode = _disaggregate(
        name, prefill_shape, decode_shape, env, model_root, tmp_path
    )
    _assert_tokens(want, got)
    computed, loaded, hits, total = _sources(got)
    prompts = sum(len(w) for w in WAVES)
    parts = _layer_parts(prefill)
    workers = prefill["tp"] * prefill.get("pp", 1)
    print(
        f"\n{name} {_shape(prefill)} -> {_shape(decode)}: {prompts} prompts identical; "
        f"decode prompt tokens: {loaded} loaded, {hits} prefix-cache hits, {computed} "
        f"computed, of {total}; prefill: {parts:.0f} layer-wise sends over {workers} "
        f"worker(s); {time.monotonic() - t0:.0f} s"
    )
    # Layer-wise sends are on: every prefill worker handed each prompt over layer by layer,
    # as its forward pass computed the layers (every prompt is prefilled in one step here).
    # A worker holds its PP stage's layers: the stages' layers sum to the model's, once per
    # TP rank.
    layers = models.MODELS[name][2]["num_hidden_layers"]
    assert parts == prompts * layers * prefill["tp"], parts
    # vLLM counts at admission, before it replays each prompt's last token to sample the
    # next one: every prompt token came from the prefix cache or from the prefill instance.
    metrics = got["metrics"]
    assert computed == 0, metrics
    assert loaded + hits == total, metrics
    assert hits > 0, metrics  # the second wave met the first in the decode's prefix cache


@pytest.mark.parametrize("tp_prefill,tp_decode", [(1, 1), (2, 1), (1, 2)])
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_disaggregated_equals_colocated(name, tp_prefill, tp_decode, env, model_root, tmp_path):
    _disaggregated_equals_colocated(
        name, {"tp": tp_prefill}, {"tp": tp_decode}, env, model_root, tmp_path
    )


def test_blocks_of_64(env, model_root, tmp_path):
    """Both instances with blocks of 64 tokens: the page tables say 64, whole blocks move,
    and the decode's prefix-cache hits (whole blocks of 64) leave loads that start at its
    block boundaries."""
    _disaggregated_equals_colocated(
        "llama", {"tp": 1, "block_size": 64}, {"tp": 1, "block_size": 64},
        env, model_root, tmp_path,
    )


@pytest.mark.parametrize("bs_prefill,bs_decode", [(32, 64), (64, 32)])
def test_different_block_sizes_prefill_on_the_decode(
    bs_prefill, bs_decode, env, model_root, tmp_path
):
    """Blocks of 32 tokens on one instance and 64 on the other cannot be mapped: vLLM's CPU
    cache stores each head's K transposed (``[dim][token]``) before its V, and kvferry's
    planner re-blocks only heads whose tokens are contiguous (moved anyway, every prompt's
    tokens came out wrong from the first, 5-token prompt on). The decode instance sees the
    prefill's block size in ``kv_transfer_params``, says why once, and prefills every prompt
    itself: the tokens are still the co-located instance's, nothing is loaded. Greedy tokens
    do not depend on the block size: the co-located instance gives the same with blocks of 32
    and of 64 (asserted)."""
    t0 = time.monotonic()
    want = colocated("llama", model_root, tmp_path, env, bs_decode)
    other = colocated("llama", model_root, tmp_path, env, bs_prefill)
    assert other == want, (
        f"the co-located tokens differ between blocks of {bs_prefill} and {bs_decode}"
    )
    got, prefill, decode = _disaggregate(
        "llama",
        {"tp": 1, "block_size": bs_prefill},
        {"tp": 1, "block_size": bs_decode},
        env,
        model_root,
        tmp_path,
    )
    _assert_tokens(want, got)
    computed, loaded, hits, total = _sources(got)
    log = (tmp_path / "decode.log").read_text(errors="replace")
    said = [line for line in log.splitlines() if "cannot be re-blocked" in line]
    print(
        f"\nllama {_shape(prefill)} -> {_shape(decode)}: tokens identical, prefilled on the "
        f"decode: {loaded} loaded, {hits} prefix-cache hits, {computed} computed, of {total}; "
        f"{time.monotonic() - t0:.0f} s\n{said[0].strip()[:300] if said else ''}"
    )
    assert len(said) == 1, said  # once per prefill instance
    assert f"has blocks of {bs_prefill} tokens, this instance {bs_decode}" in said[0]
    assert not loaded, got["metrics"]
    assert computed + hits == total and computed > 0, got["metrics"]


@pytest.mark.parametrize(
    "prefill_shape,decode_shape",
    [
        ({"tp": 1, "pp": 2}, {"tp": 1}),
        ({"tp": 1, "pp": 2}, {"tp": 2}),
        ({"tp": 1}, {"tp": 1, "pp": 2}),
    ],
    ids=["pp2-tp1", "pp2-tp2", "tp1-pp2"],
)
def test_pipeline_parallel(prefill_shape, decode_shape, env, model_root, tmp_path):
    """An instance at PP 2 (Llama's 4 layers, 2 a stage): each stage's worker describes only
    its own layers (rank ``pp_rank * tp + tp_rank`` of ``tp1pp2``). A PP prefill's workers
    send their layers layer-wise and the decode's request carries both workers' endpoints,
    so a decode worker takes layers 0-1 from one and 2-3 from the other (and at TP 2, its
    KV head of each); a PP decode's workers each load their own stage's layers. vLLM's CPU
    build runs PP only compiled (``instance.py``): the PP instance computes with
    torch.compile, the other and the co-located reference eagerly, and the tokens must still
    match."""
    _disaggregated_equals_colocated(
        "llama", prefill_shape, decode_shape, env, model_root, tmp_path
    )


@pytest.mark.parametrize(
    "extra,expected",
    [
        ({"bogus_key": 1}, "unknown kv_connector_extra_config key 'bogus_key'"),
        ({"cpus": "some"}, 'cpus must be "all", "inherit" or a list of CPU ids'),
        # The MLA-latent planner serves DeepSeek's latent caches, not Llama's heads.
        ({"planner": "kvferry.deepseek_mla_latent"}, "does not support LlamaForCausalLM tp1"),
    ],
    ids=["unknown-key", "bad-value", "planner-refuses"],
)
def test_bad_configuration_stops_vllm_at_start(extra, expected, env, model_root, tmp_path):
    model, tokenizer = models.make(model_root, "llama")
    spec = {
        "role": "decode",
        "model": str(model),
        "tokenizer": str(tokenizer),
        "tp": 1,
        "waves": [["w1 w2"]],
        "max_tokens": 1,
        "extra": {**connector_config(env), "instance": "decode-bad", **extra},
        "params": str(tmp_path / "never.json"),
        "out": str(tmp_path / "out.json"),
        "wait_s": 1,
    }
    log = tmp_path / "decode.log"
    proc = _run(spec, tmp_path / "decode.spec", env, log)
    code = proc.wait(timeout=TIMEOUT_S)
    text = log.read_text(errors="replace")
    assert code != 0
    assert "kvferry" in text and expected in text, text[-3000:]
    line = next(line for line in text.splitlines() if expected in line)
    print(f"\n{extra}: vLLM stopped at start: {line.strip()[:200]}")


def test_a_decode_request_queued_beyond_the_lease_keeps_its_kv(env, model_root, tmp_path):
    """The prefill's lease is 1.5 s; the decode instance runs one sequence at a time and a
    local 500-token generation goes first, so the loading requests wait in vLLM's queue
    several leases long (within the ten leases a hold may reach: a first try with 1,500
    tokens queued them past 20 s of a 2 s lease, and they failed cleanly as "held by its
    receiver for 20000 ms"). The connector holds them (every third of ``lease_ms``), they
    still load, and their tokens are the co-located instance's."""
    lease_ms = 1500
    want = colocated("llama", model_root, tmp_path, env)
    model, tokenizer = models.make(model_root, "llama")
    extra = {**connector_config(env), "lease_ms": lease_ms}
    common = {"model": str(model), "tokenizer": str(tokenizer), "waves": [WAVES[0][:3]]}
    prefill = {
        **common,
        "role": "prefill",
        "tp": 1,
        "extra": {**extra, "instance": "prefill-held"},
        "out": str(tmp_path / "params.json"),
        "out_after": str(tmp_path / "prefill-after.json"),
        "release": str(tmp_path / "release"),
    }
    rng = random.Random(11)
    decode = {
        **common,
        "role": "decode",
        "tp": 1,
        "max_tokens": MAX_TOKENS,
        "max_num_seqs": 1,
        "blocker": {"prompt": " ".join(_words(rng, 8)), "tokens": 500},
        "extra": {**extra, "instance": "decode-held"},
        "params": prefill["out"],
        "out": str(tmp_path / "decode.json"),
    }
    got = _run_pair(prefill, decode, tmp_path, env)
    for i, (a, b) in enumerate(zip(want[0][:3], got["outputs"][0], strict=True)):
        assert b["tokens"] == a["tokens"], f"prompt {i}: {b['tokens']} vs {a['tokens']}"
    queued = got["seconds"][0]
    loaded = got["metrics"].get("vllm:prompt_tokens_by_source{source=external_kv_transfer}")
    total = sum(o["prompt_tokens"] for o in got["outputs"][0])
    print(
        f"\nqueued behind a local generation for {queued:.1f} s (lease {lease_ms / 1e3:.1f} s): "
        f"{loaded} of {total} prompt tokens loaded, tokens identical"
    )
    # The wave waited in the queue for more than twice the lease: without holds the prefill
    # would have let the data go.
    assert 2 * lease_ms / 1e3 < queued < 10 * lease_ms / 1e3, got["seconds"]
    assert loaded == total, got["metrics"]
