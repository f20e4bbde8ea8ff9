"""Prints each passed case's result (tokens compared, largest logit difference) after the run."""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    from test_real_models import RESULTS

    if RESULTS:
        terminalreporter.section("real-model end to end")
        for line in RESULTS:
            terminalreporter.write_line(line)
