"""Bytes per committed token that the target's features add on the wire (:mod:`common.features`), measured: the
same greedy decoding over gRPC on 127.0.0.1 with and without a feature request, the edge's byte counters of the
answers (``GrpcBackend.wire_stats``, protobuf message sizes) compared per committed token.

    python -m specdec.bench.feature_bytes [TARGET_DIR] [--tokens N] [--json]

Plain decoding steps (empty blocks: one committed token, one feature vector per Verdict) are the worst case for
the per-message framing; a block that commits k tokens carries k vectors in one FeatureBlock. The open answer's
prompt features are counted apart (one vector per prompt token but the last).
"""

from __future__ import annotations

import argparse
import json

__all__ = ["feature_bytes_at", "measure_feature_bytes"]


def _decode(backend, prompt: list[int], num_tokens: int, request) -> tuple[int, int]:
    """(bytes of the open answer, bytes of the verdicts) of ``num_tokens`` plain decoding steps."""
    from specdec_runtime.common.types import DraftBlock, OpenRequest, SamplingParams, StoppingCriteria

    opened = backend.open_session(OpenRequest(prompt, SamplingParams(), StoppingCriteria(num_tokens, ignore_eos=True),
                                              features=request))
    opened_bytes = backend.wire_stats(opened.session_id).bytes_received
    committed = opened.committed_length
    for seq in range(1, num_tokens + 1):
        verdict = backend.submit(opened.session_id, seq, committed, DraftBlock([], features=request)).result(60)
        committed = verdict.committed_length
    total = backend.wire_stats(opened.session_id).bytes_received
    backend.close_session(opened.session_id)
    return opened_bytes, total - opened_bytes


def feature_bytes_at(address: str, layers: tuple[int, ...], num_tokens: int = 32,
                     prompt: list[int] | None = None) -> dict:
    """Bytes per committed token (and per prompt token) that features of ``layers`` add, float16 and int8, on
    the verifier at ``address`` (gRPC): ``{encoding: {"bytes_per_committed_token", "bytes_per_prompt_token"}}``
    plus ``verdict_bytes_per_token_without_features``."""
    from specdec_runtime.common.features import FLOAT16, INT8, FeatureRequest
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend

    prompt = prompt or list(range(100, 164))
    with GrpcBackend(address) as backend:
        base_open, base = _decode(backend, prompt, num_tokens, None)
        out: dict = {"verdict_bytes_per_token_without_features": base / num_tokens}
        for encoding in (FLOAT16, INT8):
            opened, verdicts = _decode(backend, prompt, num_tokens, FeatureRequest(tuple(layers), encoding))
            out[encoding] = {"bytes_per_committed_token": (verdicts - base) / num_tokens,
                             "bytes_per_prompt_token": (opened - base_open) / (len(prompt) - 1)}
    return out


def measure_feature_bytes(target_dir=None, num_tokens: int = 32, prompt: list[int] | None = None) -> dict:
    """The measured figures (bytes per committed token and per prompt token, per layout and encoding) for the
    target in ``target_dir`` (default: the prepared SmolLM2-135M)."""
    from specdec.embedded import EmbeddedServer
    from specdec.models import default_model_paths
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier

    runner = TargetRunner(target_dir or default_model_paths().target_dir)
    n = runner.num_layers
    prompt = prompt or list(range(100, 164))
    layouts = {"last_hidden": (-1,), "eagle3_three_layers": (2, n // 2, n - 3)}
    out = {"target_hidden_size": int(runner.config.hidden_size), "num_tokens": num_tokens,
           "prompt_tokens": len(prompt), "layouts": {}}
    with EmbeddedServer(verifier=Verifier(runner), grace_s=1.0) as address:
        for name, layers in layouts.items():
            measured = feature_bytes_at(address, layers, num_tokens, prompt)
            out["verdict_bytes_per_token_without_features"] = measured.pop("verdict_bytes_per_token_without_features")
            for encoding, figures in measured.items():
                out["layouts"][f"{name}/{encoding}"] = figures
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target_dir", nargs="?", default=None)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args(argv)
    print(json.dumps(measure_feature_bytes(args.target_dir, args.tokens), indent=1))


if __name__ == "__main__":
    main()
