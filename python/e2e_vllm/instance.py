"""One vLLM instance (offline ``LLM`` API) of the end-to-end check, run as its own process.

    python instance.py SPEC_JSON

SPEC_JSON names the model, tokenizer, TP size (and optionally ``pp``, the PP size, and
``block_size``, 32 unless given), role, the prompts (in waves, each generated after the one
before, so later waves meet earlier ones in the prefix cache) and files:
``colocated`` generates every prompt here; ``prefill`` (``kv_producer``) prefills each
prompt with ``do_remote_decode``, writes the ``kv_transfer_params`` its outputs carry, then
keeps serving the transfers until the ``release`` file appears; ``decode`` (``kv_consumer``)
starts, waits for those ``kv_transfer_params`` and generates each prompt from them. Each
writes JSON: the generated token ids, and vLLM's counters of where prompt tokens came from
(``vllm:prompt_tokens_by_source``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = None
    if spec["role"] != "colocated":
        kv = KVTransferConfig(
            kv_connector="KvferryConnector",
            kv_connector_module_path="kvferry.vllm",
            kv_role="kv_producer" if spec["role"] == "prefill" else "kv_consumer",
            kv_load_failure_policy=spec.get("failure_policy", "fail"),
            kv_connector_extra_config=spec["extra"],
        )
    pp = spec.get("pp", 1)
    llm = LLM(
        model=spec["model"],
        tokenizer=spec["tokenizer"],
        dtype="float32",
        block_size=spec.get("block_size", 32),
        # vLLM's CPU model runner makes the buffers a later PP stage receives its input in only
        # in its compile warm-up, which enforce_eager skips: eager PP 2 fails its first step
        # ("assert self.intermediate_tensors is not None" in the second stage's worker).
        enforce_eager=pp == 1,
        max_model_len=2048,
        tensor_parallel_size=spec["tp"],
        pipeline_parallel_size=pp,
        distributed_executor_backend="mp" if spec["tp"] * pp > 1 else None,
        enable_prefix_caching=True,
        disable_log_stats=False,
        seed=0,
        kv_transfer_config=kv,
        **({"max_num_seqs": spec["max_num_seqs"]} if "max_num_seqs" in spec else {}),
    )
    waves = spec["waves"]  # lists of prompts, generated one list after the other
    out_path = Path(spec["out"])
    if spec["role"] == "prefill":
        params = SamplingParams(
            temperature=0,
            max_tokens=1,
            extra_args={"kv_transfer_params": {"do_remote_decode": True}},
        )
        result = []
        for wave in waves:
            outputs = llm.generate(wave, params, use_tqdm=False)
            result.append([o.kv_transfer_params for o in outputs])
        _write(out_path, {"params": result, "metrics": _metrics(llm)})
        release = Path(spec["release"])
        deadline = time.monotonic() + spec.get("serve_s", 900)
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        _write(Path(spec["out_after"]), {"metrics": _metrics(llm)})
        return
    remote = None
    if spec["role"] == "decode":
        params_file = Path(spec["params"])
        deadline = time.monotonic() + spec.get("wait_s", 900)
        while not params_file.exists():
            if time.monotonic() > deadline:
                sys.exit(f"no {params_file} after {spec.get('wait_s', 900)} s")
            time.sleep(0.2)
        remote = json.loads(params_file.read_text())["params"]
    result = []
    seconds = []
    for w, wave in enumerate(waves):
        if remote is None:
            params = [SamplingParams(temperature=0, max_tokens=spec["max_tokens"])] * len(wave)
        else:
            params = [
                SamplingParams(
                    temperature=0,
                    max_tokens=spec["max_tokens"],
                    extra_args={"kv_transfer_params": p},
                )
                for p in remote[w]
            ]
        blocker = spec.get("blocker") if w == 0 else None
        if blocker:
            # A local request first: with max_num_seqs 1 the wave's requests queue behind it.
            wave = [blocker["prompt"], *wave]
            params = [
                SamplingParams(temperature=0, max_tokens=blocker["tokens"], ignore_eos=True),
                *params,
            ]
        t0 = time.monotonic()
        outputs = llm.generate(wave, params, use_tqdm=False)
        seconds.append(time.monotonic() - t0)
        if blocker:
            outputs = outputs[1:]
        result.append(
            [
                {
                    "tokens": list(o.outputs[0].token_ids),
                    "prompt_tokens": len(o.prompt_token_ids),
                    "finish_reason": o.outputs[0].finish_reason,
                }
                for o in outputs
            ]
        )
    _write(out_path, {"outputs": result, "metrics": _metrics(llm), "seconds": seconds})


def _metrics(llm) -> dict[str, float]:
    """vLLM's counters that say where prompt tokens came from, and kvferry's."""
    found: dict[str, float] = {}
    for metric in llm.get_metrics():
        if not metric.name.startswith(("vllm:prompt_tokens", "vllm:kvferry", "vllm:kv_cache")):
            continue
        labels = ",".join(
            f"{k}={v}"
            for k, v in sorted(metric.labels.items())
            if k not in ("model_name", "engine")
        )
        key = f"{metric.name}{{{labels}}}" if labels else metric.name
        value = getattr(metric, "value", None)
        if value is None and hasattr(metric, "count"):
            value = metric.count
        if value is not None:
            found[key] = found.get(key, 0) + value
    return found


def _write(path: Path, data: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


if __name__ == "__main__":
    main()
