"""The `kvferry` command an installed wheel puts on the environment's PATH (the entry point
kvferry._cli:main, which execs the binary shipped beside the planners): it lists the
package's planners, diagnoses the UCX it loads (the libucx-cu12 wheel's, never the build
machine's), and passes arguments, environment and exit codes through.

Runs against a wheel install (scripts/test-python); skipped where the package has no planners
(a build in the checkout ships no command).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import kvferry
import pytest

PLANNER_IDS = ["kvferry.deepseek_mla_latent", "kvferry.default"]


@pytest.fixture(scope="module")
def command() -> str:
    if not os.path.isdir(kvferry.PLUGIN_DIR):
        pytest.skip("not an installed wheel: no planners in the package, no command")
    # The script pip wrote for the entry point, beside this interpreter.
    path = os.path.join(os.path.dirname(sys.executable), "kvferry")
    assert os.access(path, os.X_OK), f"the wheel installed no `kvferry` entry point at {path}"
    return path


def site_packages() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(kvferry.__file__)))


@pytest.fixture(scope="module")
def empty(tmp_path_factory) -> str:
    """A plugin directory with no planner in it."""
    return str(tmp_path_factory.mktemp("no-planners"))


@pytest.fixture(scope="module")
def runs(command, empty, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Each case's `kvferry ARGS`, all started at once (each loads Python and UCX twice, about
    a second), with none of the variables that would move the plugin path or UCX away from
    the package's own, plus the case's own."""
    config = tmp_path_factory.mktemp("config") / "kvferry.toml"
    config.write_text(f'plugin_dir = "{empty}"\n')
    cases: dict[str, tuple[list[str], dict[str, str]]] = {
        "planners": (["planners", "--json"], {}),
        "planners-env": (["planners"], {"KVFERRY_PLUGIN_DIR": empty}),
        "planners-config": (["--config", str(config), "planners", "--json"], {}),
        "doctor": (["doctor", "--json"], {}),
        "usage": (["no-such-command"], {}),
    }
    moves = ("KVFERRY_PLUGIN_DIR", "KVFERRY_CONFIG", "KVFERRY_UCX_EXPECTED_DIR", "LD_LIBRARY_PATH")
    base = {k: v for k, v in os.environ.items() if k not in moves and not k.startswith("UCX_")}
    started = {
        name: subprocess.Popen(
            [command, *args],
            env={**base, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (args, env) in cases.items()
    }
    done = {}
    for name, p in started.items():
        stdout, stderr = p.communicate(timeout=120)
        done[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return done


def test_planners_lists_the_packages_own(runs):
    out = runs["planners"]
    assert out.returncode == 0, out
    listed = json.loads(out.stdout)
    assert listed["dirs"] == [kvferry.PLUGIN_DIR], listed
    assert sorted(p["id"] for p in listed["planners"]) == PLANNER_IDS, listed
    for p in listed["planners"]:
        assert os.path.dirname(p["path"]) == kvferry.PLUGIN_DIR, p


def test_the_plugin_path_keeps_its_order(runs, empty):
    """KVFERRY_PLUGIN_DIR, then a configuration's plugin_dir, come before the package's
    planners, as for any installed `kvferry`; an empty directory fails `planners` with exit
    status 1, which the entry point passes on."""
    out = runs["planners-env"]
    assert out.returncode == 1, out
    assert f"no planners found in {empty}" in out.stdout, out
    out = runs["planners-config"]
    assert out.returncode == 1, out
    assert json.loads(out.stdout)["dirs"] == [empty], out.stdout


def test_doctor_finds_the_wheels_ucx(runs):
    out = runs["doctor"]
    report = json.loads(out.stdout)
    # Exit status 1 exactly when doctor names a problem; here only a GPU's could be one.
    assert out.returncode == (1 if report["problems"] else 0), (out.returncode, report)
    assert not [p for p in report["problems"] if "GPU" not in p], report["problems"]
    assert report["kvferry"] == kvferry.__version__, report
    ucx_lib = os.path.join(site_packages(), "libucx", "lib")
    loaded = report["ucx"]["loaded"]
    names = sorted(os.path.basename(p).split(".so")[0] for p in loaded)
    assert "libucp" in names and len(names) == len(set(names)), loaded
    assert all(os.path.dirname(p) == ucx_lib for p in loaded), (ucx_lib, loaded)
    assert report["ucx"]["multi_threaded"], report["ucx"]
    host_tcp = [
        t for t in report["transports"] if t["transport"] == "tcp" and t["memory"] == "host"
    ]
    assert host_tcp and host_tcp[0]["error"] is None, report["transports"]


def test_a_usage_error_passes_through(runs):
    out = runs["usage"]
    assert out.returncode == 2, out
    assert "unrecognized subcommand 'no-such-command'" in out.stderr, out.stderr
    assert "Usage: kvferry" in out.stderr, out.stderr
