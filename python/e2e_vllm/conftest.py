"""The end-to-end checks' shared fixtures: the environment the vLLM processes run in, and where
the tiny models are saved."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def env() -> dict[str, str]:
    plugin_dir = os.environ.get("KVFERRY_E2E_PLUGIN_DIR")
    if not plugin_dir:
        pytest.fail("KVFERRY_E2E_PLUGIN_DIR (the planner's folder) is not set")
    e = dict(os.environ)
    # 1 GiB of KV cache per instance: four instances fit in this machine's memory.
    e.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM binds each CPU worker's threads to cores of its own ("auto"): two instances on this
    # 2-core machine then pin both workers, each spinning (sched_yield) between steps, to core
    # 0, and an order for a worker waited up to a minute. Shared hosts leave binding off.
    e.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    return e


@pytest.fixture(scope="session")
def model_root(tmp_path_factory) -> Path:
    found = os.environ.get("KVFERRY_E2E_MODELS")
    return Path(found) if found else tmp_path_factory.mktemp("models")
