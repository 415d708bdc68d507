"""Spec-Bench-style benchmarks (``specdec bench``).

:func:`run_bench` — per prompt, in one process and interleaved (the order of the variants rotates from prompt to
prompt, so a slow patch of a shared machine hits each variant alike):

- ``target_only``: the EdgeClient with no drafter (empty blocks: one target token per verify step);
- ``specdec``: the EdgeClient with the ONNX draft (:class:`edge_client.drafting.drafter.ModelDrafter`);
- ``hf_assisted``: HF transformers assisted generation, ``target.generate(assistant_model=draft_pt)``, with the
  PyTorch form of the draft (see :func:`draft_pytorch_source`).

(a) and (b) share ONE :class:`~cloud_verifier.target.runner.TargetRunner` / :class:`~cloud_verifier.verifier.Verifier`
behind the in-process :class:`~edge_client.transport.backend.LocalBackend`, so the target is loaded once and both pay the
same verifier overheads. (c) uses a separately loaded HF model with standard SDPA attention. All three decode
greedily from the same prompt token ids (chat template, first turn of each question) with the same
max_new_tokens and EOS; the report records whether their token ids agree.

:func:`run_clients_bench` — N concurrent edge clients (threads; each with its own ONNX draft session and gRPC
channel) against ONE verifier on loopback gRPC, batched vs the same verifier verifying one block per forward
pass (``max_batch_size=1``).

:func:`run_replay_bench` (``--replay --clients 1,16,64``) — the verifier under load: draft blocks recorded once from a
real edge client (cached), replayed by N concurrent sessions of ONE asyncio process against a ``specdec serve``
process on cores of its own; tokens/s vs the same verifier with one block per forward pass, the kernel limit (N
single-row forwards vs one N-row forward), verdicts checked against the recording, the verifier's memory.

:func:`run_gamma_sweep` (``--gamma-sweep 1-8``) — one shared target, interleaved per prompt: target-only decoding,
fixed γ = each value, and adaptive γ with and without confidence truncation; acceptance, τ, draft cost per token
relative to a target forward, tokens/s and speedup per γ and per category; optional PNG plot
(:func:`plot_gamma_sweep`, matplotlib as an optional dependency).

:func:`run_edge_cloud_bench` (``--edge-cloud``) — the verifier as a separate ``specdec serve`` process pinned to
one core, the edge client in this process pinned to another, loopback gRPC plus a simulated one-way delay:
cloud-only decoding vs specdec with proactive drafting off and on, at each delay, interleaved per prompt.

Every rate is a ratio of sums (total tokens / total wall time; accepted / drafted), never a mean of ratios.

One module per benchmark (:mod:`.offline`, :mod:`.clients`, :mod:`.gamma_sweep`, :mod:`.edge_cloud`), the prompts
(:mod:`.prompts`), HF assisted generation (:mod:`.hf_assisted`), the verifier subprocess
(:mod:`.verifier_process`), the report printer (:mod:`.report`) and helpers they share (:mod:`._shared`).
"""

from __future__ import annotations

# _shared first: importing it sets OMP_WAIT_POLICY before anything here can load torch.
from ._shared import WARMUP_NEW_TOKENS, target_placement  # isort: skip
from .clients import CLIENTS_DEFAULT_LIMIT, run_clients_bench
from .edge_cloud import EDGE_CLOUD_VARIANTS, parse_delays_ms, run_edge_cloud_bench
from .gamma_sweep import SWEEP_ADAPTIVE_VARIANTS, parse_gamma_sweep, plot_gamma_sweep, run_gamma_sweep
from .hf_assisted import HF_DRAFT_MODES, draft_pytorch_source
from .offline import VARIANTS, run_bench
from .prompts import BenchPrompt, load_prompts
from .replay import REPLAY_DEFAULT_DURATION_S, run_replay_bench
from .report import print_report
from .verifier_process import VERIFIER_STARTUP_TIMEOUT_S, VerifierProcessError
from .verifier_process import VerifierProcess  # noqa: F401  (the tests start one directly)

__all__ = [
    "BenchPrompt",
    "CLIENTS_DEFAULT_LIMIT",
    "REPLAY_DEFAULT_DURATION_S",
    "EDGE_CLOUD_VARIANTS",
    "HF_DRAFT_MODES",
    "SWEEP_ADAPTIVE_VARIANTS",
    "VARIANTS",
    "VERIFIER_STARTUP_TIMEOUT_S",
    "VerifierProcessError",
    "WARMUP_NEW_TOKENS",
    "draft_pytorch_source",
    "load_prompts",
    "parse_delays_ms",
    "parse_gamma_sweep",
    "plot_gamma_sweep",
    "print_report",
    "run_bench",
    "run_clients_bench",
    "run_edge_cloud_bench",
    "run_gamma_sweep",
    "run_replay_bench",
    "target_placement",
]
