"""The logits-processing flags of `generate`, `chat` and `bench` (one definition, the same names everywhere):
``--repetition-penalty --presence-penalty --frequency-penalty --logit-bias ID=BIAS --min-tokens --min-p
--logprobs N``, turned into the SDK's generation options (:func:`edge_client.request.generation_params`).
Order and semantics of the processors: :mod:`common.logits_processors`."""

from __future__ import annotations

from typing import Optional

import typer

from specdec.cli._shared import fail

REPETITION_PENALTY = typer.Option(1.0, "--repetition-penalty",
                                  help="HF repetition penalty over prompt + output (> 0, 1 = off)")
PRESENCE_PENALTY = typer.Option(0.0, "--presence-penalty", help="OpenAI presence penalty over the output ([-2, 2])")
FREQUENCY_PENALTY = typer.Option(0.0, "--frequency-penalty",
                                 help="OpenAI frequency penalty over the output ([-2, 2])")
LOGIT_BIAS = typer.Option([], "--logit-bias", help="ID=BIAS added to token ID's logit ([-100, 100]; repeatable)")
MIN_TOKENS = typer.Option(0, "--min-tokens", help="EOS and stop token ids masked until this many tokens")
MIN_P = typer.Option(0.0, "--min-p", help="Drop tokens below min_p x the top probability ([0, 1], 0 = off)")
LOGPROBS = typer.Option(None, "--logprobs", help="Report each token's log-probability and its N most likely "
                        "alternatives (raw target log-softmax; 0..20)")


def parse_logit_bias(items: list[str]) -> dict[int, float]:
    """``["ID=BIAS", ...]`` as {id: bias}, or exit with one line naming the bad item."""
    out: dict[int, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[int(key)] = float(value)
        except ValueError:
            fail(f"--logit-bias takes ID=BIAS (an integer token id, a number), got {item!r}")
    return out


def processing_options(*, repetition_penalty: float, presence_penalty: float, frequency_penalty: float,
                       logit_bias: list[str], min_tokens: int, min_p: float,
                       logprobs: Optional[int]) -> dict:
    """The generation options of these flags (only the ones set, so the defaults stay the SDK's), checked by
    :meth:`common.types.SamplingParams.validate` (a bad value exits with one line naming the field)."""
    from specdec_runtime.common.types import SamplingParams

    opts: dict = {}
    for name, value, neutral in (("repetition_penalty", repetition_penalty, 1.0),
                                 ("presence_penalty", presence_penalty, 0.0),
                                 ("frequency_penalty", frequency_penalty, 0.0), ("min_tokens", min_tokens, 0),
                                 ("min_p", min_p, 0.0)):
        if value != neutral:
            opts[name] = value
    bias = parse_logit_bias(logit_bias)
    if bias:
        opts["logit_bias"] = bias
    if logprobs is not None:
        opts["logprobs"], opts["top_logprobs"] = True, int(logprobs)
    try:
        SamplingParams(**opts).validate()
    except ValueError as e:
        # the one field whose name is not its flag's: say which flag set it
        fail(f"--logprobs: {e}" if str(e).startswith("top_logprobs") else str(e))
    return opts


def format_logprobs(result, tokenizer) -> list[str]:
    """One line per generated token: index, id, text, logprob, then the alternatives as id:text:logprob."""
    lines = []
    for j, (t, lp) in enumerate(zip(result.token_ids, result.logprobs or ())):
        alts = " ".join(f"{i}:{tokenizer.decode([i])!r}:{v:.4f}" for i, v in zip(lp.top_token_ids, lp.top_logprobs))
        lines.append(f"{j}\t{t}\t{tokenizer.decode([t])!r}\t{lp.logprob:.4f}" + (f"\t{alts}" if alts else ""))
    return lines
