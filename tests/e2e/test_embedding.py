"""The SDK is safe to embed: an app whose folder has its own ``common/`` package (a very common name), with
PyPI's unrelated ``common`` distribution installed too, imports specdec and generates token-identical to
target-only decoding. The runtime imports itself only as ``specdec_runtime.*`` (setup.py), so neither ``common``
shadows ours; the test also shows that a bare ``import common.types`` in that app resolves to the app's own
module (what the runtime's imports resolved to before it had a namespace)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _reference import hf_greedy
from specdec_runtime.edge_client.request import encode_prompt

pytestmark = pytest.mark.timeout(300)

PROMPT = "Name three colors."
MAX_NEW = 12
APP_COMMON = {
    "__init__.py": "WHOSE = 'the app'\n",
    "types.py": "SamplingParams = 'the app owns this name'\n",
    "errors.py": "raise ImportError('the app hides this module')\n",
}
APP = textwrap.dedent("""
    import json, sys
    import common, common.types
    from specdec import EdgeClient, SamplingParams
    address, draft_dir, prompt, max_new = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    with EdgeClient.connect(address, draft_dir) as client:
        ids = client.generate(prompt, max_new_tokens=max_new, ignore_eos=True).token_ids
    ours = sorted(name for name, m in sys.modules.items()
                  if name.split(".")[0] == "common" and "specdec_runtime" in (getattr(m, "__file__", "") or ""))
    print(json.dumps({"ids": ids, "common": getattr(common, "WHOSE", common.__file__),
                      "common_types": str(common.types.SamplingParams), "sdk": SamplingParams.__module__,
                      "ours_as_common": ours}))
""")


@pytest.fixture(scope="module")
def verifier_address(tiny_pair):
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec.embedded import EmbeddedServer

    with EmbeddedServer(verifier=Verifier(TargetRunner(tiny_pair.target_dir)), grace_s=1.0) as address:
        yield address


def _app(tmp_path: Path) -> Path:
    app = tmp_path / "app"
    for name, text in APP_COMMON.items():
        (app / "common" / name).parent.mkdir(parents=True, exist_ok=True)
        (app / "common" / name).write_text(text)
    (app / "main.py").write_text(APP)
    return app


def test_an_app_with_its_own_common_generates_target_only_tokens(tiny_pair, verifier_address, tmp_path):
    from transformers import AutoTokenizer

    installed = subprocess.run([sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec('common')"
                                ".origin)"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert "site-packages" in installed.stdout, installed  # PyPI's `common` (a test extra) is installed
    expected = hf_greedy(tiny_pair.target_dir, encode_prompt(AutoTokenizer.from_pretrained(tiny_pair.target_dir),
                                                             PROMPT), MAX_NEW)
    app = _app(tmp_path)
    proc = subprocess.run([sys.executable, "main.py", verifier_address, str(tiny_pair.draft_dir), PROMPT,
                           str(MAX_NEW)], cwd=app, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ids"] == expected
    assert out["common"] == "the app" and out["common_types"] == "the app owns this name"  # the app's shadows
    assert out["sdk"].startswith("specdec_runtime.common.")
    assert out["ours_as_common"] == []


def test_pypi_common_beside_the_sdk(tiny_pair, verifier_address, tmp_path):
    """From a folder without its own ``common``: the installed distribution's ``common`` is the one imported,
    and the SDK still generates."""
    app = _app(tmp_path)
    for name in APP_COMMON:
        (app / "common" / name).unlink()
    (app / "common").rmdir()
    proc = subprocess.run([sys.executable, "main.py", verifier_address, str(tiny_pair.draft_dir), PROMPT, "4"],
                          cwd=app, capture_output=True, text=True, timeout=240)
    # PyPI's common has no common.types: the app's `import common.types` fails there, after nothing of ours
    assert proc.returncode == 1 and "No module named 'common.types'" in proc.stderr, proc.stderr
    check = subprocess.run([sys.executable, "-c", "import common, specdec; from specdec import SamplingParams; "
                            "print(common.__file__)"], cwd=app, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and "site-packages" in check.stdout, check.stderr
