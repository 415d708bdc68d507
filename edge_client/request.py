"""What one generation is asked: the prompt's token ids and the sampling/stopping parameters of the SDK's
generation options (:meth:`edge_client.client.EdgeClient.stream_chunks`, a
:class:`edge_client.conversation.Conversation`'s turns), built and checked in one place.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from specdec_runtime.common.chat import encode_ids, render_chat_ids
from specdec_runtime.common.errors import InvalidRequestError
from specdec_runtime.common.types import SamplingParams, StoppingCriteria

__all__ = ["GENERATION_OPTIONS", "check_generation_options", "encode_prompt", "generation_options",
           "generation_params"]

# keyword options of a generation (those of generation_params)
GENERATION_OPTIONS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids",
                      "ignore_eos", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
                      "min_tokens", "min_p", "logprobs", "top_logprobs", "grammar", "drafter_invariant")


def check_generation_options(options: Mapping) -> None:
    """Raise InvalidRequestError when ``options`` has a key outside :data:`GENERATION_OPTIONS`."""
    unknown = sorted(set(options) - set(GENERATION_OPTIONS))
    if unknown:
        raise InvalidRequestError(f"unknown generation option(s) {', '.join(unknown)}: use "
                                  f"{', '.join(GENERATION_OPTIONS)}")


def generation_params(
    *,
    # the defaults are the parameter types' own (common.types): one set for the SDK, the CLI and edge-serve
    max_new_tokens: int = StoppingCriteria.max_new_tokens,
    temperature: float = SamplingParams.temperature,
    top_k: int = SamplingParams.top_k,
    top_p: float = SamplingParams.top_p,
    seed: int | None = None,
    stop: Iterable[str] = (),
    stop_token_ids: Iterable[int] = (),
    ignore_eos: bool = StoppingCriteria.ignore_eos,
    repetition_penalty: float = SamplingParams.repetition_penalty,
    presence_penalty: float = SamplingParams.presence_penalty,
    frequency_penalty: float = SamplingParams.frequency_penalty,
    logit_bias: Mapping[int, float] | None = None,
    min_tokens: int = SamplingParams.min_tokens,
    min_p: float = SamplingParams.min_p,
    logprobs: bool = SamplingParams.logprobs,
    top_logprobs: int = SamplingParams.top_logprobs,
    grammar=None,
    drafter_invariant: bool | None = None,
) -> tuple[SamplingParams, StoppingCriteria]:
    """The sampling parameters and stopping criteria of one generation, checked.

    Args:
        max_new_tokens: generated tokens at most (>= 1).
        temperature: 0 = greedy; top_k: 0 = off; top_p: in [0, 1], 1 = off, 0 = the most likely token only;
            seed: None = the verifier picks.
        stop: stop strings (non-empty); stop_token_ids: token ids that end the generation besides EOS.
        ignore_eos: do not stop at EOS.
        repetition_penalty: HF's, over prompt + output (> 0, 1 = off); presence_penalty / frequency_penalty:
            OpenAI's, over the output ([-2, 2], 0 = off); logit_bias: token id -> bias in [-100, 100];
            min_tokens: EOS and stop token ids masked until that many tokens are generated; min_p: in [0, 1]
            (0 = off). Order and sources: :mod:`common.logits_processors`.
        logprobs: report each generated token's log-probability (raw log-softmax of the target);
            top_logprobs: and that many alternatives (0..20).
        grammar: structured output: a :class:`common.grammar.GrammarSpec` (json_object, json_schema, regex, choice,
            Lark/GBNF grammar) or its JSON; None = none. Checked by compiling it on the verifier at OpenSession.
        drafter_invariant: sampled tokens that do not depend on the draft or the route's switch points (the
            target-only draws of the seed; fewer accepted tokens); None = on for seeded ``auto``, ``cloud`` and
            ``cloud-first`` generations (:func:`edge_client.generation.plan.plan_generation`).

    Raises:
        InvalidRequestError: a parameter out of range, naming it (:meth:`SamplingParams.validate`,
            :meth:`StoppingCriteria.validate`), or min_tokens above max_new_tokens.
    """
    sampling = SamplingParams(
        temperature, top_k, top_p, seed, repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, logit_bias=dict(logit_bias or {}), min_tokens=min_tokens, min_p=min_p,
        logprobs=bool(logprobs or top_logprobs), top_logprobs=top_logprobs, grammar=_grammar_json(grammar),
        drafter_invariant=None if drafter_invariant is None else bool(drafter_invariant))
    stopping = StoppingCriteria(max_new_tokens, tuple(stop_token_ids), tuple(stop), bool(ignore_eos))
    try:
        sampling.validate()
        stopping.validate()
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    if min_tokens > max_new_tokens:  # EOS would stay masked past the end: never what was meant
        raise InvalidRequestError(f"min_tokens must be <= max_new_tokens ({max_new_tokens}), got {min_tokens}")
    return sampling, stopping


def _grammar_json(grammar) -> str:
    """A grammar option as the JSON SamplingParams carries ("" for None). Raises InvalidRequestError."""
    if grammar is None or grammar == "":
        return ""
    from specdec_runtime.common.grammar import GrammarSpec

    try:
        spec = grammar if isinstance(grammar, GrammarSpec) else GrammarSpec.from_json(grammar)
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(f"grammar: {e}") from None
    return spec.to_json()


def generation_options(sampling: SamplingParams) -> dict:
    """The sampling options of :func:`generation_params` that give ``sampling`` back (its inverse)."""
    return dict(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, seed=sampling.seed,
                repetition_penalty=sampling.repetition_penalty, presence_penalty=sampling.presence_penalty,
                frequency_penalty=sampling.frequency_penalty, logit_bias=dict(sampling.logit_bias),
                min_tokens=sampling.min_tokens, min_p=sampling.min_p, logprobs=sampling.logprobs,
                top_logprobs=sampling.top_logprobs, grammar=sampling.grammar or None,
                drafter_invariant=sampling.drafter_invariant)


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """Prompt token ids: through the tokenizer's chat template (one user turn) when it has one and ``chat``;
    special-token strings in ``prompt`` stay literal text (:func:`common.chat.render_chat_ids`).

    Raises:
        InvalidRequestError: empty prompt.
    """
    if not prompt or not prompt.strip():
        raise InvalidRequestError("empty prompt")
    if chat and getattr(tokenizer, "chat_template", None):  # content stays text (common.chat)
        return render_chat_ids(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True)
    return encode_ids(tokenizer, prompt, add_special_tokens=True)  # locked: a shared tokenizer (common.chat)
