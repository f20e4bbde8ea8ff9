"""Prints each passed case's result (tokens compared, largest logit difference) after the run."""

from __future__ import annotations

import sys


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    tests = sys.modules.get("test_real_models")
    if tests is not None and tests.RESULTS:
        terminalreporter.section("real-model end to end")
        for line in tests.RESULTS:
            terminalreporter.write_line(line)
