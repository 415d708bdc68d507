"""The README's SDK snippet, copied into a file and run as written (the default prepared models): text, then the
statistics on their own line; it imports from the front door only (``from specdec import ...``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


def test_readme_sdk_snippet_runs_as_written(real_pair, tmp_path):
    section = (ROOT / "README.md").read_text().split("## SDK", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert re.findall(r"^(?:from|import) (\S+)", snippet, re.M) == ["specdec"], snippet
    script = tmp_path / "snippet.py"
    script.write_text(snippet)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.rstrip("\n").splitlines()
    assert len(lines) >= 2 and any(line.strip() for line in lines[:-1])  # some text
    assert re.fullmatch(r"acceptance \d\.\d\d, mean accepted length \d+\.\d\d", lines[-1]), lines[-1]
