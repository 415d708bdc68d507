"""edge_client.generation.run: a Run commits and cuts at the earliest stop, its result counts what it committed,
and with_seed fixes a seed once."""

from __future__ import annotations

from conftest import PROMPT_IDS
from specdec_runtime.common.types import FinishReason, SamplingParams, StoppingCriteria
from specdec_runtime.edge_client.generation.run import Run, with_seed
from specdec_runtime.edge_client.output import TextOutput


def test_run_result_and_seed(room_draft):
    tok = room_draft.tokenizer
    run = Run(list(PROMPT_IDS), StoppingCriteria(4), TextOutput(tok, ()), committed=list(PROMPT_IDS))
    tokens, reason = run.cut([5, 6, 7], None)
    assert (tokens, reason) == ([5, 6, 7], None)
    run.committed.extend(tokens)
    run.finish_reason, run.session_ids = FinishReason.LENGTH, ["s1"]
    result = run.result(tok, None, 0.0)
    assert result.token_ids == [5, 6, 7]
    assert result.stats.num_generated_tokens == 3 and result.num_sessions == 1 and result.bytes_sent == 0
    assert result.finish_reason == FinishReason.LENGTH and result.session_id == "s1"
    seeded = with_seed(SamplingParams(temperature=0.7))
    assert seeded.seed is not None and with_seed(seeded) == seeded
