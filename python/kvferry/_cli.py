"""The ``kvferry`` command of an installed wheel: the command-line binary (``host/cli``) that
the wheel ships beside its planners, ``kvferry/planners/kvferry``, run with this process's
arguments in its place (``exec``: the same pid, standard streams, signals and exit code).

Sitting beside the planners, the binary finds them the way every ``kvferry`` does with no
configuration (the directory of the running executable), after ``KVFERRY_PLUGIN_DIR`` and a
configuration's ``plugin_dir``. It loads UCX from the ``libucx-cu12`` wheel through its
RUNPATH (``$ORIGIN/../../libucx/lib``, the same copy ``import kvferry`` loads); this sets
``KVFERRY_UCX_EXPECTED_DIR`` to that directory, unless it is set, so that ``kvferry doctor``
checks the loaded UCX against it rather than against the build machine's.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

#: The command-line binary inside the package.
BINARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "planners", "kvferry")


def _wheel_ucx_dir() -> str | None:
    """The libucx-cu12 wheel's library directory beside this package, if it is installed
    there: where the binary's RUNPATH points."""
    site = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    lib = os.path.join(site, "libucx", "lib")
    return lib if os.path.isdir(lib) else None


def main(argv: list[str] | None = None) -> NoReturn:
    """Replaces this process with ``kvferry ARGS`` (``argv``: default ``sys.argv[1:]``)."""
    args = sys.argv[1:] if argv is None else argv
    if not os.access(BINARY, os.X_OK):
        sys.exit(
            f"kvferry: the command's binary {BINARY} is missing or not executable "
            "(this package was not installed from a wheel scripts/wheel built)"
        )
    env = dict(os.environ)
    ucx = _wheel_ucx_dir()
    if ucx is not None and not env.get("KVFERRY_UCX_EXPECTED_DIR"):
        env["KVFERRY_UCX_EXPECTED_DIR"] = ucx
    # Buffered output of this interpreter must not be lost when exec replaces it.
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(BINARY, ["kvferry", *args], env)
    except OSError as e:
        sys.exit(f"kvferry: cannot run {BINARY}: {e}")
