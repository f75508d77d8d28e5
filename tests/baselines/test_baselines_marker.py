"""The ``baselines`` marker: a missing baseline skips a test, or fails it where required.

Runs pytest on made-up tests under this directory's conftest.py (the hooks that read the
marker) with and without METALEARN_REQUIRE_BASELINES.
"""

from __future__ import annotations

import pytest

from tests.conftest import REQUIRE_BASELINES, ROOT

TESTS = """
import pytest

@pytest.mark.baselines("metalearn_has_no_such_module")
def test_needs_a_missing_module():
    pass

@pytest.mark.baselines("torch", "metalearn_has_no_such_module")
def test_needs_one_present_and_one_missing():
    pass

@pytest.mark.baselines("torch")
def test_needs_a_present_module():
    pass

def test_unmarked():
    pass
"""


@pytest.fixture
def made_up(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    baselines: needs the modules named\n")
    pytester.makepyfile(test_made_up=TESTS)
    return pytester


@pytest.mark.parametrize("value", [None, "", "0"])
def test_a_missing_baseline_skips_by_default(made_up, monkeypatch, value):
    if value is None:
        monkeypatch.delenv(REQUIRE_BASELINES, raising=False)
    else:
        monkeypatch.setenv(REQUIRE_BASELINES, value)
    result = made_up.runpytest("-rs")
    result.assert_outcomes(passed=2, skipped=2)
    result.stdout.fnmatch_lines(["*metalearn_has_no_such_module not installed here*"])


@pytest.mark.parametrize("value", ["1", "true"])
def test_a_missing_baseline_fails_where_required(made_up, monkeypatch, value):
    monkeypatch.setenv(REQUIRE_BASELINES, value)
    result = made_up.runpytest()
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines([f"*{REQUIRE_BASELINES} is set: metalearn_has_no_such_module*"])


def test_the_marker_must_name_its_modules(pytester: pytest.Pytester):
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile("import pytest\n\n@pytest.mark.baselines\ndef test_x():\n    pass\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*@pytest.mark.baselines names the modules*"])
