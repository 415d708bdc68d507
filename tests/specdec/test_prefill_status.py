"""The CLI's prefill status line and timing summary (specdec/cli/progress.py): drawn on a terminal only, erased
when it stops, and the summary's decode speed is decode tokens over decode time (never the whole wall time)."""

from __future__ import annotations

import io

from specdec.cli.progress import PrefillStatus, timing_summary
from specdec_runtime.edge_client.stats import GenerationStats


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_status_drawn_on_a_terminal_and_erased_at_stop():
    out = _Terminal()
    with PrefillStatus(6012, stream=out, interval_s=3600) as status:  # the first draw is immediate
        assert "prefill: 6012 prompt tokens, 0 s" in out.getvalue()
        status.stop()
        status.stop()  # idempotent: erased once
    text = out.getvalue()
    assert text.endswith("\r\x1b[K") and text.count("\r\x1b[K") == 2  # drawn once, erased once
    assert "\n" not in text  # nothing left on the terminal's lines


def test_no_status_off_a_terminal():
    out = io.StringIO()  # a pipe or a log file: a failed run must stay one error line there
    with PrefillStatus(10, stream=out, interval_s=0.01):
        pass
    assert out.getvalue() == ""
    forced = io.StringIO()
    with PrefillStatus(None, stream=forced, enabled=True, interval_s=3600):
        pass
    assert forced.getvalue().startswith("\r\x1b[Kprefill: 0 s") and "prompt tokens" not in forced.getvalue()


def test_summary_reports_the_two_phases():
    s = GenerationStats(num_generated_tokens=16, elapsed_s=10.0, ttft_s=8.0, num_decode_tokens=12, decode_s=2.0)
    line = timing_summary(s)
    assert line == "16 tokens, 10.00 s, TTFT 8.00 s, 6.0 tok/s decode", line  # 12 / 2, not 16 / 10
    assert "no token" in timing_summary(GenerationStats())
    assert GenerationStats(num_decode_tokens=0, decode_s=0.0).decode_tokens_per_s == 0.0
    one = timing_summary(GenerationStats(num_generated_tokens=1, elapsed_s=2.0, ttft_s=2.0))
    assert one == "1 token, 2.00 s, TTFT 2.00 s, no decode step", one  # not "1 tokens ... 0.0 tok/s decode"
