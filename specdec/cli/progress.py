"""What the CLI shows of a generation's timing: a live status while the prompt is prefilled, and the summary of
its two phases (time to first token, then the decode speed).

Standard library only: an edge install (``specdec-edgecloud[edge]``) has neither rich nor tqdm.
"""

from __future__ import annotations

import sys
import threading
import time

_ERASE_LINE = "\r\x1b[K"  # carriage return, then clear to the end of the line (ANSI EL)


class PrefillStatus:
    """A status line on stderr while a generation prefills its prompt ("prefill: N prompt tokens, S s"), redrawn
    every ``interval_s`` seconds by a daemon thread and erased by :meth:`stop` (at the first token, or any end),
    so that what follows (text on stdout, the statistics or an error line on stderr) starts on a clean line.

    On a terminal only (``stream.isatty()``; ``enabled`` overrides it): a pipe or a log file would keep every
    redraw, and a failed run must stay one ``error: ...`` line there; the statistics line's TTFT says afterwards
    how long the prefill took. A context manager; :meth:`stop` may be called any number of times.

    Args:
        num_prompt_tokens: the prompt's length, tokens (None: not shown).
        stream: where to draw (default ``sys.stderr``).
        enabled: draw or not (default: ``stream`` is a terminal).
        interval_s: seconds between redraws (> 0).
    """

    def __init__(self, num_prompt_tokens: int | None = None, stream=None, enabled: bool | None = None,
                 interval_s: float = 0.5) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.enabled = _is_terminal(self.stream) if enabled is None else bool(enabled)
        self.num_prompt_tokens = num_prompt_tokens
        self.interval_s = float(interval_s)
        self._stopped = threading.Event()
        self._lock = threading.Lock()  # one writer at a time: the redraw thread, or stop()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._drawn = False

    def __enter__(self) -> PrefillStatus:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Draw the line now and keep redrawing it until :meth:`stop` (nothing when disabled)."""
        if not self.enabled or self._thread is not None:
            return
        self._t0 = time.monotonic()
        self._draw()
        self._thread = threading.Thread(target=self._run, name="specdec-prefill-status", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop redrawing and erase the line (once; later calls do nothing)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._drawn:
                self.stream.write(_ERASE_LINE)
                self.stream.flush()
                self._drawn = False

    def text(self) -> str:
        """The status as drawn now."""
        tokens = f"{self.num_prompt_tokens} prompt tokens, " if self.num_prompt_tokens is not None else ""
        return f"prefill: {tokens}{time.monotonic() - self._t0:.0f} s (the first token ends it)"

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            self._draw()

    def _draw(self) -> None:
        with self._lock:
            if self._stopped.is_set():
                return
            self.stream.write(_ERASE_LINE + self.text())
            self.stream.flush()
            self._drawn = True


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def timing_summary(stats) -> str:
    """The timing part of a statistics line: tokens, wall time, then the two phases — time to first token (both
    prefills and the first step) and the decode speed over the tokens after it (``GenerationStats``'s
    ``ttft_s`` and ``decode_tokens_per_s``; no decode speed when every token came with the first)."""
    n = stats.num_generated_tokens
    ttft = "no token" if stats.ttft_s is None else f"TTFT {stats.ttft_s:.2f} s"
    decode = f"{stats.decode_tokens_per_s:.1f} tok/s decode" if stats.num_decode_tokens else "no decode step"
    return f"{n} token{'' if n == 1 else 's'}, {stats.elapsed_s:.2f} s, {ttft}, {decode}"


class DraftDownloadProgress:
    """Progress of a draft download from the verifier on stderr (``edge_client.delivery``'s ``progress``
    callback): on a terminal one line redrawn per chunk ("draft: model.onnx 12.5/25.0 MB 50%"), elsewhere one
    line per file once it is complete, so a log keeps what was fetched."""

    def __init__(self, stream=None, enabled: bool | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.live = _is_terminal(self.stream) if enabled is None else enabled
        self.files = 0

    def __call__(self, path: str, have: int, size: int) -> None:
        text = f"draft: {path} {have / 1e6:.1f}/{size / 1e6:.1f} MB {100 * have // max(size, 1)}%"
        if self.live:
            self.stream.write(_ERASE_LINE + text + ("\n" if have >= size else ""))
        elif have >= size:
            self.stream.write(text + "\n")
        else:
            return
        self.files += have >= size
        self.stream.flush()
