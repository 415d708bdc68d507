"""Draft time per token of a draft head (:class:`edge_client.drafting.head_model.OnnxHead`) against the target's
one-token forward, measured on this machine: a head of EAGLE-3's shape for the target (random weights: the cost
does not depend on them), exported as ``specdec models export-head`` does.

    python -m specdec.bench.head_cost HEAD_CHECKPOINT_DIR [TARGET_DIR]

Prints JSON: head ms per drafted token (one entry after ``past`` cached entries, median), the target's one-token
forward ms after as many cached tokens (``time_forward``), and their ratio.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

__all__ = ["measure_head_cost"]


def measure_head_cost(head_checkpoint, target_dir=None, past: int = 100, repeats: int = 50) -> dict:
    import numpy as np

    from specdec.bench._shared import time_forward
    from specdec.models import default_model_paths
    from specdec.models.head_export import export_head
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.edge_client.drafting.head_model import OnnxHead

    target_dir = target_dir or default_model_paths().target_dir
    with tempfile.TemporaryDirectory() as tmp:
        head = OnnxHead(export_head(target_dir, head_checkpoint, tmp))
        rng = np.random.default_rng(0)
        head.forward([int(t) for t in rng.integers(0, 1000, past)], rng.standard_normal((past, head.hidden_size)))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            head.forward([5], rng.standard_normal((1, head.hidden_size)))
            times.append((time.perf_counter() - t0) * 1000)
            head.rollback(past)
        head_ms = float(np.median(times))
        draft_vocab = int(head.meta["draft_vocab_size"])
    target_ms = time_forward(TargetRunner(target_dir), 1, past_tokens=past, repeats=repeats)
    return {"draft_vocab_size": draft_vocab, "head_ms_per_token": head_ms, "target_forward_ms": target_ms,
            "ratio": head_ms / target_ms}


if __name__ == "__main__":
    print(json.dumps(measure_head_cost(*sys.argv[1:3]), indent=1))
