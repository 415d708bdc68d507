"""The deployment run for real: scripts/deploy_check.sh builds the images (local base images, the wheelhouse, no
registry), brings the compose stack up with host networking, generates through nginx with a replica container
SIGKILLed mid-run and again with the survivor alone, then the profile "sentinel" with the Redis master container
SIGKILLed mid-generation: every generation token-identical to `specdec generate --target-only`, and nothing of the
stack left after `compose down`. Runs where Docker answers (.ci/run starts dockerd), minutes (the first run
builds the base images and the wheelhouse; later runs reuse them)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NO_DOCKER = "docker does not answer: no Docker daemon on this machine (scripts/deploy_check.sh needs one)"


def _docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=30, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.real_model
@pytest.mark.timeout(2400)
def test_deploy_check_script():
    if not _docker_answers():
        pytest.skip(NO_DOCKER)
    env = {**os.environ, "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(ROOT / "scripts" / "deploy_check.sh")], capture_output=True, text=True,
                         timeout=2300, env=env, cwd=str(ROOT), check=False)
    out = run.stdout + run.stderr
    print(out[-8000:])
    assert run.returncode == 0, out[-6000:]
    assert out.count("token-identical to --target-only: True") == 4, out[-6000:]
    assert "token-identical to --target-only: False" not in out
    assert "the serving replica SIGKILLed mid-run" in out and "the Redis master SIGKILLed mid-run" in out
    assert out.count("containers, networks or volumes of specdec-deploy-check left") == 2
    assert " 0 containers, networks or volumes" in out and "== deploy check passed" in out
