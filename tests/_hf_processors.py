"""HF transformers' equivalents of specdec's logits pipeline (common/logits_processors.py), as independent
references: HF's own processors where it has them (SequenceBiasLogitsProcessor, RepetitionPenaltyLogitsProcessor,
MinNewTokensLengthLogitsProcessor), and a documented custom one for OpenAI's presence/frequency penalties (HF
has none): logit[t] -= frequency * count_output[t] + presence * (count_output[t] > 0), counting only the tokens
generated after the prompt (vLLM's semantics)."""

from __future__ import annotations

import functools

import torch
from transformers import (
    AutoModelForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from specdec_runtime.common.types import SamplingParams


class PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI presence/frequency penalties over the generated tokens (after ``prompt_length``)."""

    def __init__(self, presence: float, frequency: float, prompt_length: int):
        self.presence, self.frequency, self.prompt_length = presence, frequency, prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = input_ids[:, self.prompt_length:]  # [batch, generated]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def hf_processors(params: SamplingParams, prompt_length: int, eos_token_ids: list[int]) -> LogitsProcessorList:
    """The history-dependent part of ``params`` as HF processors, in specdec's order."""
    procs = []
    if params.logit_bias:
        procs.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in params.logit_bias]))
    if params.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        procs.append(PresenceFrequencyPenalty(params.presence_penalty, params.frequency_penalty, prompt_length))
    if params.min_tokens:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_length, params.min_tokens, eos_token_ids))
    return LogitsProcessorList(procs)


def hf_greedy_processed(model_dir, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
                        eos_token_id: int | None = None) -> list[int]:
    """Greedy HF generate() with the processors of ``params``; stops at ``eos_token_id`` (None: never, as with
    ignore_eos). Returns the generated ids (EOS included when it stopped there)."""
    model = _model(str(model_dir))
    eos = [] if eos_token_id is None else [eos_token_id]
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
            logits_processor=hf_processors(params, len(prompt_ids), eos or [2]),
            eos_token_id=eos_token_id if eos_token_id is not None else None,
            **({} if eos else {"min_new_tokens": max_new_tokens}),
        )
    return out[0, len(prompt_ids):].tolist()


@functools.lru_cache(maxsize=2)
def _model(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
