"""Model preparation's progress on a stderr that is not a terminal: one plain line per step, no bar."""

from __future__ import annotations

from specdec.models._util import Progress


def test_plain_lines_when_stderr_is_not_a_terminal(capsys):
    bar = Progress(2, "target x", enabled=True)
    bar.step("dequantizing")
    bar.advance()
    bar.step("saving")
    bar.advance()
    bar.close()
    err = capsys.readouterr().err
    assert err.splitlines() == ["target x: step 1/2: dequantizing", "target x: step 2/2: saving"]
    assert "\r" not in err


def test_disabled_prints_nothing(capsys):
    bar = Progress(1, "x", enabled=False)
    bar.step("a")
    bar.advance()
    bar.close()
    assert capsys.readouterr().err == ""
