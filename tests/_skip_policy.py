"""Skip policy: with ``SPECDEC_REQUIRE_ALL=1`` (set by .ci/run) a skipped test fails the run unless its skip reason
is in :data:`SKIP_ALLOWLIST`.

A skip is how a test says "this machine lacks something I need" (no Redis, no model wheel, ...). Locally that is a
convenience; in CI it would hide a broken environment behind a green run. So under SPECDEC_REQUIRE_ALL=1:

- a test skipped in setup or in its body (``pytest.skip``, a ``skip``/``skipif`` marker, a fixture that skips)
  is reported as FAILED, with the skip reason in its report;
- a module skipped at collection (``pytest.importorskip`` at module level, ``pytest.skip(allow_module_level=True)``)
  cannot be turned into a test failure, so the run's exit status is set to "tests failed" and the reasons are
  listed in the terminal summary;
- xfail is not a skip and is left alone.

Allowed skips are those that cannot run on a CI machine by design (GPU-only tests); add a reason here only with
that argument. ``SPECDEC_ALLOWED_SKIPS`` adds reasons for one run (``|``-separated substrings).

Registered by tests/conftest.py (pytest_configure); tests/test_skip_policy.py runs it with pytester (``-p _skip_policy``).
"""

from __future__ import annotations

import os

import pytest

REQUIRE_ALL_ENV = "SPECDEC_REQUIRE_ALL"
EXTRA_ALLOWED_ENV = "SPECDEC_ALLOWED_SKIPS"

# Substrings of skip reasons that stay skips under SPECDEC_REQUIRE_ALL=1.
SKIP_ALLOWLIST: tuple[str, ...] = (
    "CUDA not available",  # GPU-only tests on a CPU machine
    # an instruction-set build that this CPU cannot execute (the AVX2 and plain-C builds still run everywhere)
    "this CPU has no AVX-512",
    # opt-in: a fresh venv installed from the package index (minutes, and the network) is not a CI step
    "SPECDEC_SLOW_INSTALL_TEST=1 not set",
    # the deployment check needs a Docker daemon; .ci/run installs docker.io and starts one where it can
    "docker does not answer: no Docker daemon on this machine",
)


def require_all() -> bool:
    return os.environ.get(REQUIRE_ALL_ENV, "") == "1"


def allowed(reason: str) -> bool:
    extra = tuple(s for s in os.environ.get(EXTRA_ALLOWED_ENV, "").split("|") if s)
    return any(s in reason for s in SKIP_ALLOWLIST + extra)


def skip_reason(report) -> str:
    """The reason of a skipped test or collection report ("Skipped: " prefix removed)."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        reason = str(longrepr[2])
    else:
        reason = str(longrepr)
    return reason.removeprefix("Skipped: ")


def _offending(report) -> bool:
    return report.skipped and not hasattr(report, "wasxfail") and not allowed(skip_reason(report))


class SkipPolicy:
    """The hooks, with per-run state (one instance per pytest config: pytester runs nest)."""

    def __init__(self) -> None:
        self.collect_skips: list[tuple[str, str]] = []

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        if require_all() and _offending(report):
            reason = skip_reason(report)
            report.outcome = "failed"
            report.longrepr = (
                f"skipped ({reason}), but {REQUIRE_ALL_ENV}=1 and this reason is not in the allow-list "
                f"(tests/_skip_policy.py SKIP_ALLOWLIST): the environment lacks something this test needs"
            )
        return report

    def pytest_collectreport(self, report):
        if require_all() and _offending(report):
            self.collect_skips.append((report.nodeid, skip_reason(report)))

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config):
        if self.collect_skips:
            terminalreporter.section(f"{REQUIRE_ALL_ENV}=1: skipped at collection, not allowed", red=True)
            for nodeid, reason in self.collect_skips:
                terminalreporter.line(f"SKIPPED {nodeid}: {reason}")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        if self.collect_skips and exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


PLUGIN_NAME = "specdec-skip-policy"


def pytest_configure(config):
    """Register the policy (as ``-p _skip_policy`` or from tests/conftest.py)."""
    if not config.pluginmanager.has_plugin(PLUGIN_NAME):
        config.pluginmanager.register(SkipPolicy(), PLUGIN_NAME)
