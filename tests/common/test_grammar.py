"""common.grammar: specs, compile errors and cache, per-position block masks, roll-back, forced tokens, replay.

All on the real SmolLM2 tokenizer (49152 ids) with the llguidance engine; no model runs.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from specdec_runtime.common.grammar import GrammarSpec, apply_mask, compile_grammar, grammar_tokenizer

EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
        "pos": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"],
                "additionalProperties": False},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "pos", "ok"],
    "additionalProperties": False,
}
DOC = '{"name": "Ada", "age": 36, "tags": ["a", "ccc"], "pos": {"x": 1.5}, "ok": true}'


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(smollm2_tokenizer_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def gtok(tok):
    return grammar_tokenizer(tok, [EOS])


def ids_of(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def test_spec_validation_and_round_trip():
    for bad, msg in ((("yaml", ""), "unknown grammar kind"), (("json_schema", "{x"), "not valid JSON"),
                     (("json_schema", "[1]"), "JSON object"), (("choice", '["a", 3]'), "list of non-empty"),
                     (("choice", "[]"), "list of non-empty"), (("regex", ""), "must not be empty")):
        with pytest.raises(ValueError, match=msg):
            GrammarSpec(*bad)
    for spec in (GrammarSpec("json_object"), GrammarSpec.json_schema(SCHEMA), GrammarSpec("regex", r"\d+"),
                 GrammarSpec.choice(["yes", "no"]), GrammarSpec("grammar", 'root ::= "a" | "b"')):
        assert GrammarSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match="grammar spec"):
        GrammarSpec.from_json('{"kind": "regex", "value": "a", "extra": 1}')
    # the schema's key order is kept (the grammar emits properties in that order)
    assert list(json.loads(GrammarSpec.json_schema(SCHEMA).value)["properties"]) == list(SCHEMA["properties"])


@pytest.mark.parametrize("spec, engine_message", [
    (GrammarSpec("regex", "a(b"), "unclosed group"),
    (GrammarSpec("json_schema", '{"type": "frob"}'), "frob"),
    (GrammarSpec("grammar", "start: foo"), "unknown name"),
])
def test_invalid_grammar_is_a_value_error_with_the_engines_message(gtok, spec, engine_message):
    with pytest.raises(ValueError, match=engine_message) as e:
        compile_grammar(spec, gtok)
    assert str(e.value).startswith(f"invalid {spec.kind}:")


def test_compile_cache_per_spec_and_tokenizer(gtok, tok):
    a = compile_grammar(GrammarSpec.json_schema(SCHEMA), gtok)
    assert compile_grammar(GrammarSpec.json_schema(json.dumps(SCHEMA)), gtok) is a
    other_eos = grammar_tokenizer(tok, [EOS, 0])
    assert compile_grammar(GrammarSpec.json_schema(SCHEMA), other_eos) is not a
    # two matchers of one compiled grammar are independent
    m1, m2 = a.matcher(), a.matcher()
    m1.advance(ids_of(tok, '{"name'))
    assert m1.num_tokens > 0 and m2.num_tokens == 0


def test_block_masks_are_the_masks_along_the_draft_and_leave_the_state(gtok, tok):
    compiled = compile_grammar(GrammarSpec.json_schema(SCHEMA), gtok)
    m = compiled.matcher()
    ids = ids_of(tok, DOC)
    masks = m.block_masks(ids, width=49160)  # padded logits: 8 ids the tokenizer does not have
    assert masks.shape == (len(ids) + 1, 49160) and m.num_tokens == 0
    ref = compiled.matcher()
    for i, t in enumerate(ids):
        assert np.array_equal(masks[i], ref.mask(49160)) and masks[i][t]
        assert not masks[i][49152:].any()
        ref.advance([t])
    assert np.flatnonzero(masks[-1]).tolist() == [EOS]  # the object is complete: only EOS


def test_a_forbidden_draft_token_is_masked_and_later_rows_are_unconstrained(gtok, tok):
    m = compile_grammar(GrammarSpec.json_schema(SCHEMA), gtok).matcher()
    good = ids_of(tok, '{"name": "')
    draft = ids_of(tok, '{"nome": "')  # no such key
    masks = m.block_masks(draft)
    n_ok = m.num_valid(draft)
    assert 0 < n_ok < len(draft) and not masks[n_ok][draft[n_ok]]
    assert all(masks[i][draft[i]] for i in range(n_ok))
    assert masks[n_ok + 1:].all()  # never used by the verdict; all True keeps the row's softmax finite
    assert m.num_tokens == 0 and m.num_valid(good) == len(good)


def test_advance_is_all_or_none_and_rollback_restores(gtok, tok):
    m = compile_grammar(GrammarSpec.json_schema(SCHEMA), gtok).matcher()
    ids = ids_of(tok, DOC)
    m.advance(ids[:5])
    cp, before = m.checkpoint(), m.mask()
    with pytest.raises(ValueError, match="forbids token"):
        m.advance(ids[5:8] + ids_of(tok, "@@@"))
    assert m.num_tokens == cp and np.array_equal(m.mask(), before)
    m.advance(ids[5:])
    m.restore(cp)
    assert np.array_equal(m.mask(), before)


def test_eos_rolled_back_and_consumed_again(gtok, tok):
    # llguidance 1.9 refuses EOS after rolling an EOS back; the matcher takes EOS itself
    m = compile_grammar(GrammarSpec.choice(["yes", "no"]), gtok).matcher()
    m.advance(ids_of(tok, "yes"))
    for _ in range(3):
        m.advance([EOS])
        assert m.is_finished and np.flatnonzero(m.mask()).tolist() == [EOS]
        with pytest.raises(ValueError):
            m.advance([EOS])  # nothing after EOS
        m.rollback(1)
    assert m.num_tokens == len(ids_of(tok, "yes"))
    with pytest.raises(ValueError, match="forbids token 2 at output position 0"):
        compile_grammar(GrammarSpec.choice(["yes", "no"]), gtok).matcher().advance([EOS])


def test_replay_equals_step_by_step(gtok, tok):
    compiled = compile_grammar(GrammarSpec.json_schema(SCHEMA), gtok)
    ids = ids_of(tok, DOC)[:17]
    a, b = compiled.matcher(), compiled.matcher()
    for t in ids:
        a.advance([t])
    b.advance(ids_of(tok, '{"name": "Bob"'))
    b.replay(ids)
    assert b.num_tokens == a.num_tokens and np.array_equal(a.mask(), b.mask())


def test_forced_tokens_are_the_single_allowed_ids(gtok, tok):
    compiled = compile_grammar(GrammarSpec.json_schema(SCHEMA), gtok)
    m = compiled.matcher()
    forced = m.forced_tokens(16)
    assert tok.decode(forced).startswith('{"name')
    assert m.num_tokens == 0
    probe = compiled.matcher()
    for t in forced:
        assert np.flatnonzero(probe.mask()).tolist() == [t]
        probe.advance([t])
    assert np.count_nonzero(probe.mask()) > 1  # it stops where a choice opens
    # after "age" is written the key's rest is forced: '": '
    m.advance(ids_of(tok, '{"name": "Ada", "age'))
    assert tok.decode(m.forced_tokens(4)).startswith('": ')
    done = compile_grammar(GrammarSpec.choice(["yes", "no"]), gtok).matcher()
    done.advance(ids_of(tok, "yes"))
    assert done.forced_tokens(4) == [EOS]


@pytest.mark.parametrize("seed", range(6))
def test_random_walks_under_the_mask_validate(gtok, tok, seed):
    """Any path the mask allows ends in a document that parses and validates (jsonschema); the negative control
    (the same walk without the mask) does not."""
    rng = np.random.default_rng(seed)
    m = compile_grammar(GrammarSpec.json_schema(SCHEMA), gtok).matcher()
    out = []
    for _ in range(300):
        allowed = np.flatnonzero(m.mask())
        # prefer short tokens so strings and numbers end (the mask alone decides what is allowed)
        short = [t for t in allowed[:4000] if len(tok.id_to_token(int(t))) <= 2] or allowed
        t = int(rng.choice(short if rng.random() < 0.9 else allowed))
        m.advance([t])
        out.append(t)
        if t == EOS:
            break
    assert out[-1] == EOS
    jsonschema.validate(json.loads(tok.decode(out[:-1])), SCHEMA)
    unmasked = [int(t) for t in rng.integers(3, 49152, size=len(out))]
    with pytest.raises((json.JSONDecodeError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(tok.decode(unmasked)), SCHEMA)


def test_regex_choice_and_ebnf_match_whole_output(gtok, tok):
    for spec, good, bad in ((GrammarSpec("regex", r"[0-9]{3}-[a-z]+"), "123-abc", "12-abc"),
                            (GrammarSpec.choice(["red", "green"]), "green", "blue"),
                            (GrammarSpec("grammar", 'root ::= "(" [a-z]+ ")"'), "(ok)", "(ok")):
        m = compile_grammar(spec, gtok).matcher()
        m.advance(ids_of(tok, good))
        assert m.is_accepting, spec
        m.advance([EOS])
        fresh = compile_grammar(spec, gtok).matcher()
        ids = ids_of(tok, bad)
        if fresh.num_valid(ids) == len(ids):
            fresh.advance(ids)
            assert not fresh.is_accepting, spec
    obj = compile_grammar(GrammarSpec("json_object"), gtok).matcher()
    first = [tok.decode([int(t)]) for t in np.flatnonzero(obj.mask())]
    assert first and all(t.startswith("{") for t in first)


def test_apply_mask_sets_forbidden_logits_to_minus_inf():
    logits = np.arange(8, dtype=np.float32).reshape(2, 4)
    mask = np.array([[True, False, True, False], [False, False, False, True]])
    apply_mask(logits, mask)
    assert np.isneginf(logits[~mask]).all() and (logits[mask] == [0, 2, 7]).all()


def test_sync_follows_a_prefix_that_grows_and_is_cut(gtok, tok):
    compiled = compile_grammar(GrammarSpec.json_schema(SCHEMA), gtok)
    ids = ids_of(tok, DOC)
    m = compiled.matcher()
    for prefix in (ids[:4], ids[:9], ids[:6], ids[:6] + ids[6:12], ids[:2], ids + [EOS], ids[:3]):
        m.sync(prefix)
        ref = compiled.matcher()
        ref.advance(prefix)
        assert m.token_ids == prefix and np.array_equal(m.mask(), ref.mask())
    m.sync(ids[:6])
    with pytest.raises(ValueError):
        m.sync(ids[:3] + ids_of(tok, "@@"))  # after the key: no string
    assert m.token_ids == ids[:3]


def test_the_spec_travels_in_sampling_params_on_the_wire_and_in_the_store_form():
    import dataclasses

    from specdec_runtime.common.types import SamplingParams
    from specdec_runtime.common.wire import sampling_from_proto, sampling_to_proto

    params = SamplingParams(temperature=0.5, grammar=GrammarSpec.json_schema(SCHEMA).to_json())
    assert sampling_from_proto(sampling_to_proto(params)) == params
    stored = json.loads(json.dumps(dataclasses.asdict(params)))  # the Redis record's sampling JSON
    assert SamplingParams(**stored) == params
    assert GrammarSpec.from_json(SamplingParams(**stored).grammar) == GrammarSpec.json_schema(SCHEMA)
    with pytest.raises(ValueError, match="grammar"):
        SamplingParams(grammar="x" * 300_000).validate()


def test_min_tokens_yields_where_the_grammar_allows_only_a_stop_id():
    """min_tokens masks EOS while other ids are left; where a grammar mask left only EOS, EOS stays (the grammar
    wins: a row of nothing but -inf has no distribution)."""
    from specdec_runtime.common.logits_processors import TokenHistory
    from specdec_runtime.common.types import SamplingParams

    history = TokenHistory(SamplingParams(min_tokens=5), 8, 1, [2], [1])
    only_eos = np.full(8, -np.inf, dtype=np.float32)
    only_eos[2] = 0.5
    assert history.apply(only_eos.copy())[2] == np.float32(0.5)
    eos_and_more = only_eos.copy()
    eos_and_more[4] = 0.1
    out = history.apply(eos_and_more, np.array([False, False, True, False, True, False, False, False]))
    assert out[2] == -np.inf and out[4] == np.float32(0.1)
