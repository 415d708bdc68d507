"""TextOutput marks the first commit (every route commits through it): the end of the prefill, for the time to
first token (GenerationStats.ttft_s) and the decode phase's token count."""

from __future__ import annotations

from specdec_runtime.edge_client.output import TextOutput


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True, **kw):
        return "".join(chr(ord("a") + i % 26) for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [chr(ord("a") + i % 26) for i in ids]


def test_first_commit_is_marked_once():
    out = TextOutput(_Tokenizer(), ())
    assert out.first_token_t is None and out.first_token_count == 0
    out.push([], verified=True)  # an empty commit (a stop inside the accepted prefix) is no first token
    assert out.first_token_t is None
    out.push([1, 2, 3], verified=True)
    first = out.first_token_t
    assert first is not None and out.first_token_count == 3
    out.push([4], verified=False)
    assert out.first_token_t == first and out.first_token_count == 3  # later commits change neither
