"""Tensor parallelism of the target (cloud_verifier/parallel/): the head plan, and TP=2 through the real verifier.

- :func:`plan_shards`: KV heads split along KV groups (evenly where they divide, contiguous and uneven where they do
  not: the default target's 9 query / 3 KV heads at N = 2), KV heads replicated where fewer than ranks, and the
  splits it cannot make refused in one line.
- TP=2 (this test process is rank 0, one spawned gloo rank): a tiny Llama (GQA 4/2) and a tiny Qwen2 (q/k/v
  biases), greedy speculative decoding and target-only decoding through :class:`Verifier` are token-identical to
  TP=1 and to HF ``generate``; each rank holds half of every decoder-layer projection (the embeddings replicated)
  and a KV pool of its own heads; rank 0 measures its all-reduce time; the second session over the prompt takes
  its pages from the prefix cache (rank 0 owns the cache, every rank's pool holds the pages' KV).
- A tiny hybrid LFM2 (a short-conv layer, then attention) at TP=2: each rank holds half of the conv's channels
  (and so half of each session's conv state); greedy speculative decoding (blocks mostly rejected: the conv state
  replayed to the accepted prefix on both ranks) and target-only decoding are token-identical to TP=1 and HF.
- Settings and targets it does not support (compile modes, hybrids other than LFM2, impossible splits) refused in
  one line from the config, before any rank starts.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specdec_runtime.cloud_verifier.parallel import RankSpec, TensorParallelError, plan_shards, start_parallel_runner
from specdec_runtime.cloud_verifier.parallel.sharding import weight_bytes
from specdec.bench.chaos.procs import free_port

# 40 ids, BOS first: two full KV pages of 16, which the second session over the same prompt takes from the prefix cache
PROMPT = [1, 504, 3458, 314, 253, 1789, 30, 357, 4564, 2517, 28, 2145, 2016, 260] * 3
PROMPT = PROMPT[:40]
NEW_TOKENS = 24
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def _cfg(heads: int, kv: int, inter: int = 128):
    return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter)


def test_plan_splits_whole_kv_groups():
    even = plan_shards(_cfg(4, 2), 2)
    assert even.kv_heads == ((0,), (1,)) and even.q_heads == ((0, 1), (2, 3))
    assert even.mlp == ((0, 64), (64, 128))
    uneven = plan_shards(_cfg(9, 3, 1536), 2)  # SmolLM2-135M: rank 0 holds two KV groups, rank 1 one
    assert uneven.kv_heads == ((0, 1), (2,)) and uneven.q_heads == ((0, 1, 2, 3, 4, 5), (6, 7, 8))
    replicated = plan_shards(_cfg(4, 1), 2)  # one KV head: each rank holds it and half of its query heads
    assert replicated.kv_heads == ((0,), (0,)) and replicated.q_heads == ((0, 1), (2, 3))
    assert plan_shards(_cfg(8, 2), 4).q_heads == ((0, 1), (2, 3), (4, 5), (6, 7))


@pytest.mark.parametrize("heads, kv, n, words", [(4, 2, 3, "split evenly"), (4, 4, 8, "cannot be split 8 ways"),
                                                 (6, 1, 4, "a multiple of 1 dividing 6")])
def test_plan_refuses_impossible_splits_in_one_line(heads, kv, n, words):
    with pytest.raises(TensorParallelError) as err:
        plan_shards(_cfg(heads, kv), n)
    assert words in str(err.value) and "\n" not in str(err.value)


def _tiny(arch: str, tmp_path_factory, tokenizer_dir):
    from transformers import AutoTokenizer

    from _architectures import make_tiny_model

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return make_tiny_model(arch, tmp_path_factory.mktemp("tp") / arch, tok)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory, smollm2_tokenizer_dir):
    return _tiny("qwen2", tmp_path_factory, smollm2_tokenizer_dir)


@pytest.fixture(scope="module")
def lfm2_dir(tmp_path_factory, smollm2_tokenizer_dir):
    return _tiny("lfm2", tmp_path_factory, smollm2_tokenizer_dir)


def _generate(runner, draft_dir, speculative: bool = True) -> tuple[list[int] | None, list[int]]:
    """(speculative tokens with the tiny ONNX draft or None, target-only tokens) through a Verifier over
    ``runner``."""
    from specdec.embedded import LocalBackend
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

    backend = LocalBackend(Verifier(runner, max_num_speculative_tokens=8, cost_table_dir=False))
    try:
        model = OnnxDraftModel(draft_dir)
        res = None
        if speculative:
            spec = EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=4)
            res = spec.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids
        plain = EdgeClient(backend, None, model.tokenizer).generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    finally:
        backend.close()
    return res, plain.token_ids


def _projection_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if any(name.endswith(f"{proj}.weight") or name.endswith(f"{proj}.bias") for proj in PROJECTIONS))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_greedy_identical_to_tp1_and_target_only(arch, tiny_pair, qwen2_dir):
    from _reference import hf_greedy
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner

    model_dir = tiny_pair.target_dir if arch == "llama" else qwen2_dir
    single = TargetRunner(model_dir, kv_cache_budget_tokens=4096)
    _, expected = _generate(single, tiny_pair.draft_dir, speculative=False)  # TP=1 target-only
    spec = RankSpec(str(model_dir), 2, f"tcp://127.0.0.1:{free_port()}", "cpu", "float32", 4096, 16, 1)
    runner = start_parallel_runner(spec)
    try:
        got_spec, got_plain = _generate(runner, tiny_pair.draft_dir)
        ranks = runner.parallel
        assert ranks.failure is None
        # the target-only session read the speculative one's cached prompt pages, on both ranks' pools
        assert runner.prefix_cache.stats.hits >= 32
        assert ranks.timer.calls > 0 and ranks.timer.total_seconds > 0  # 2 all-reduces per layer and pass
        per_rank = [s["weight_bytes"] for s in ranks.per_rank]
        kv_bytes = [s["kv_bytes"] for s in ranks.per_rank]
        shard_projections = _projection_bytes(runner.model)
    finally:
        runner.parallel.close()
    assert [p.exitcode for p in runner.parallel.procs] == [0]  # rank 1 left its loop at STOP
    assert got_spec == got_plain == expected == hf_greedy(model_dir, PROMPT, NEW_TOKENS)
    full_projections = _projection_bytes(single.model)
    assert shard_projections * 2 == full_projections  # every layer projection halved (4/2 heads, 128 features)
    full = weight_bytes(single.model)
    assert per_rank[0] == per_rank[1] == full - full_projections // 2  # the rest (embeddings, norms) replicated
    single_pool = single.kv_pool.tensor.numel() * single.kv_pool.tensor.element_size()
    assert kv_bytes == [single_pool // 2] * 2  # same pages, one of the two KV heads each


@pytest.mark.slow
def test_tp2_hybrid_lfm2_identical_to_tp1_and_target_only(tiny_pair, lfm2_dir, capfd):
    import gc

    from _reference import hf_greedy
    from specdec_runtime.cloud_verifier.kv.forward_row import ForwardRow
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner

    single = TargetRunner(lfm2_dir, kv_cache_budget_tokens=4096)
    _, expected = _generate(single, tiny_pair.draft_dir, speculative=False)  # TP=1 target-only
    spec = RankSpec(str(lfm2_dir), 2, f"tcp://127.0.0.1:{free_port()}", "cpu", "float32", 4096, 16, 1)
    runner = start_parallel_runner(spec)
    try:
        assert runner.recurrent_layers == [0]
        conv = runner.model.get_decoder().layers[0].conv
        hidden = runner.config.hidden_size
        assert conv.conv.weight.shape[0] == hidden // 2 and conv.in_proj.out_features == 3 * hidden // 2
        got_spec, got_plain = _generate(runner, tiny_pair.draft_dir)
        assert runner.parallel.failure is None
        assert runner.decoder.states.issued >= 2  # both sessions' states were mirrored on rank 1
        gc.collect()  # the closed sessions' states are gone on rank 0: the next step tells rank 1
        kv = runner.allocate(4)
        runner.forward([ForwardRow(kv, [5, 6, 7, 8], 0, "last")])
        runner.free(kv)
    finally:
        runner.parallel.close()
    assert [p.exitcode for p in runner.parallel.procs] == [0]
    # rank 1 dropped its mirrors of the closed sessions' states: only the last step's is left
    err = capfd.readouterr().err
    assert "rank 1: stopped after" in err and ", 1 recurrent states held" in err, err[-2000:]
    assert got_spec == got_plain == expected == hf_greedy(lfm2_dir, PROMPT, NEW_TOKENS)


def test_unsupported_settings_and_targets_refused_in_one_line(tiny_pair, tmp_path, smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    from _architectures import make_tiny_model
    from specdec_runtime.cloud_verifier.config import VerifierSettings
    from specdec_runtime.cloud_verifier.parallel import check_settings

    def refused(**kw) -> str:
        with pytest.raises(TensorParallelError) as err:
            check_settings(VerifierSettings(target=str(kw.pop("target", tiny_pair.target_dir)), **kw))
        assert "\n" not in str(err.value)
        return str(err.value)

    assert "compile" in refused(tensor_parallel=2, compile="torch_compile")
    assert "split evenly" in refused(tensor_parallel=3)  # 4 query / 2 KV heads over 3 ranks
    hybrid = make_tiny_model("bamba", tmp_path / "bamba", AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir)))
    assert "hybrid" in refused(tensor_parallel=2, target=hybrid)  # a Mamba2 mixer: not sharded
    check_settings(VerifierSettings(target=str(tiny_pair.target_dir), tensor_parallel=2))  # supported: no error
    check_settings(VerifierSettings(target=str(hybrid), tensor_parallel=1, compile="torch_compile"))  # TP off

