"""The replay's host time per step (host_ms_per_step, host_fraction_of_step): a real gRPC verifier replaying
recorded sessions, its /metrics read at the window's start and end exactly as `bench --replay` reads its verifier
process's; the host time of a step is present and plausible (0 < host < step)."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from specdec_runtime.cloud_verifier import metrics
from specdec_runtime.cloud_verifier.store import MemorySessionStore
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec.bench.prompts import load_prompts
from specdec.bench.replay import host_time_fields, load_or_record, read_step_times, replay_sessions
from specdec.bench.replay.host_time import preemption_fields, read_preemptions
from specdec.embedded import EmbeddedServer

pytestmark = pytest.mark.timeout(120)

PROMPTS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a haiku about autumn leaves."]},
    {"question_id": 2, "category": "math", "turns": ["What is 12 times 7?"]},
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_replay_reports_host_time_per_step(tiny_pair, tmp_path):
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    runner = TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=1 << 14)
    rec = load_or_record(prompts, load_prompts(prompts, 2), 2, tiny_pair.target_dir, tiny_pair.draft_dir,
                         lambda: runner, max_new_tokens=10, num_speculative_tokens=4, device="cpu",
                         dtype="float32", cache_dir=tmp_path / "cache")
    port = _free_port()
    metrics.serve_metrics(port, addr="127.0.0.1")  # this process's registry: the in-process verifier's batcher
    url = f"http://127.0.0.1:{port}/metrics"
    readings: dict = {}
    verifier = Verifier(runner, MemorySessionStore(ttl_s=60), max_batch_size=8)
    with EmbeddedServer(verifier=verifier) as address:
        tally = asyncio.run(replay_sessions(
            address, rec.prompts, 3, 1.5, max_new_tokens=rec.max_new_tokens,
            tokenizer_fingerprint=rec.tokenizer_fingerprint,
            on_window=lambda what: readings.__setitem__(what, read_step_times(url))))
    assert tally.errors == 0 and tally.mismatches == 0 and tally.verdicts > 0
    fields = host_time_fields(readings["start"], readings["end"])
    assert fields["steps"] > 0
    assert 0 < fields["host_ms_per_step"] < fields["step_ms_per_step"], fields
    assert 0 < fields["host_fraction_of_step"] < 1, fields
    assert 0 <= fields["collect_ms_per_step"] <= fields["host_ms_per_step"], fields
    # each batch step runs one target forward pass (the capacity comparison's forward-pass count). The window's
    # readings are taken while steps run: the pass is counted when it runs, the step when it ends, so a reading
    # that falls between the two puts one pass on the other side of a boundary (seen: 194 passes, 193 steps)
    assert abs(fields["target_forward_passes"] - fields["steps"]) <= 1, fields
    # the verifier's KV preemption counters are served (none here: the pool holds the three sessions)
    assert preemption_fields(read_preemptions(url), read_preemptions(url)) == {"kv_preemptions": 0,
                                                                               "kv_recomputed_tokens": 0}
    assert preemption_fields(None, read_preemptions(url))["kv_preemptions"] is None
    # missing readings (a verifier without /metrics) give None fields, not an error
    assert host_time_fields(None, readings["end"])["host_ms_per_step"] is None
