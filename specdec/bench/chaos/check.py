"""Every finished output of a chaos run against its reference, computed after the run on a fault-free verifier
in this process (:class:`specdec.embedded.LocalBackend`: no network, no store, no other session).

- greedy kinds (greedy, json_schema, penalties, logprobs, multiturn, cloud, openai): target-only decoding (no
  drafter: one target token per step) with the same options; the token ids must be identical, turn by turn (an
  ``openai`` request answers text: its text must be the reference's, decoded from the reference's ids, and its
  completion tokens as many);
- sampled: the same request, the same draft and γ, on the fault-free verifier (what a seed guarantees:
  docs/architecture.md, "What a seed guarantees");
- logprobs: each token's logprob within :data:`LOGPROB_TOLERANCE` of the reference's.

An outcome with an error is *lost*; a finished one shorter than its reference (a prefix of it) is *truncated*;
one that differs anywhere else is a *mismatch*; one with the right tokens but fewer logprobs than tokens is
*logprobs_missing* (the logprobs cannot be aligned with the tokens, so the rest are not compared; a block
settled from the store after a failover has its logprobs: the store commits them with the tokens). References
are computed once per distinct request.

Give the sampled kind a draft that is not the target itself: with identical weights (the tiny test pair's
``draft_dir``) p ≈ q everywhere, the residual max(0, p - q) a recovered token is drawn from is rounding noise, and
batching alone moves draws (what a seed guarantees holds "up to floating-point rounding of forward passes of
different shapes"); the tests use the differently seeded ``other_draft_dir``.
"""

from __future__ import annotations

from specdec.bench.chaos.workload import (
    GREEDY_KINDS,
    NUM_SPECULATIVE_TOKENS,
    Outcome,
    Request,
    run_request,
)

LOGPROB_TOLERANCE = 1e-4


class References:
    """The reference outcome of each distinct request (computed on first use)."""

    def __init__(self, target_dir, draft_dir):
        from specdec_runtime.cloud_verifier.target.runner import TargetRunner
        from specdec_runtime.cloud_verifier.verifier import Verifier
        from specdec_runtime.edge_client.client import EdgeClient
        from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
        from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
        from specdec.embedded import LocalBackend

        self._backend = LocalBackend(Verifier(TargetRunner(target_dir)))
        model = OnnxDraftModel(draft_dir, intra_op_num_threads=1)
        self._target_only = EdgeClient(self._backend, None, model.tokenizer)
        self._speculative = EdgeClient(self._backend, ModelDrafter(model), model.tokenizer,
                                       num_speculative_tokens=NUM_SPECULATIVE_TOKENS)
        self._cache: dict[Request, Outcome] = {}

    def of(self, request: Request) -> Outcome:
        if request not in self._cache:
            outcome = Outcome(-1, -1, request, 0.0)
            client = self._target_only if request.kind in GREEDY_KINDS else self._speculative
            run_request(client, request, outcome, route="speculative")
            self._cache[request] = outcome
        return self._cache[request]

    def close(self) -> None:
        self._backend.close()


def _text_verdict(outcome: Outcome, reference: Outcome) -> tuple[str, str]:
    """An ``openai`` outcome (text and a token count, no ids) against its reference."""
    want, n_want = reference.text or "", len(reference.turns[0])
    got, n_got = outcome.text or "", outcome.completion_tokens
    if got == want and n_got == n_want:
        # edge-serve names LENGTH and CONTEXT "length", EOS and a stop string "stop" (docs/openai.md)
        wanted = ["length" if r in ("length", "context") else "stop" for r in reference.finish_reasons]
        if outcome.finish_reasons != wanted:
            return "mismatch", f"finish reasons {outcome.finish_reasons} vs {wanted}"
        return "ok", ""
    if n_got < n_want and want.startswith(got):
        return "truncated", f"{n_got} of {n_want} tokens"
    first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return "mismatch", f"{n_got} vs {n_want} tokens; text from character {first}: {got[first:first + 24]!r} vs " \
                       f"{want[first:first + 24]!r}"


def verdict(outcome: Outcome, reference: Outcome) -> tuple[str, str]:
    """("ok" | "lost" | "truncated" | "mismatch" | "logprobs_missing", what differs)."""
    if outcome.error:
        return "lost", f"{outcome.error}: {outcome.error_message}"
    if outcome.request.kind == "openai":
        return _text_verdict(outcome, reference)
    if len(outcome.turns) != len(reference.turns):
        return "truncated", f"{len(outcome.turns)} of {len(reference.turns)} turns"
    for i, (got, want) in enumerate(zip(outcome.turns, reference.turns)):
        if got != want:
            if len(got) < len(want) and want[:len(got)] == got:
                return "truncated", f"turn {i}: {len(got)} of {len(want)} tokens"
            first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            return "mismatch", (f"turn {i}: first difference at token {first} of {len(want)}: "
                                f"{got[first:first + 4]} vs {want[first:first + 4]}")
    if outcome.finish_reasons != reference.finish_reasons:
        return "mismatch", f"finish reasons {outcome.finish_reasons} vs {reference.finish_reasons}"
    if reference.logprobs is not None:
        if outcome.logprobs is None or len(outcome.logprobs) != len(reference.logprobs):
            got = 0 if outcome.logprobs is None else len(outcome.logprobs)
            return "logprobs_missing", f"{got} of {len(reference.logprobs)} logprobs"
        worst = max((abs(a - b) for a, b in zip(outcome.logprobs, reference.logprobs)), default=0.0)
        if worst > LOGPROB_TOLERANCE:
            return "mismatch", f"logprob off by {worst:.3g}"
    return "ok", ""


def check_outcomes(outcomes: list[Outcome], references: References) -> list[dict]:
    """One row per outcome that is not ok: session, number, kind, prompt, verdict, what differs, its failovers,
    re-opened sessions and retried errors, and when it ran (s since the run's start)."""
    bad = []
    for o in outcomes:
        status, detail = ("lost", f"{o.error}: {o.error_message}") if o.error else verdict(o, references.of(o.request))
        if status != "ok":
            bad.append({"session": o.session, "number": o.number, "kind": o.request.kind, "prompt": o.request.prompt,
                        "verdict": status, "detail": detail, "num_failovers": o.num_failovers,
                        "num_reopened_sessions": o.num_reopened_sessions, "retried_errors": list(o.retried_errors),
                        "t_start": round(o.t_start, 3), "t_end": round(o.t_end, 3)})
    return bad
