"""The compiled target forward (``compile_mode``): with torch.compile, and with the CUDA-graph path's static
buffers and padding, the verify logits equal eager's and greedy speculative decoding is token-identical to
target-only decoding on a tiny model. The CUDA-graph capture itself runs where CUDA is (scripts/gpu_check.sh);
on the CPU the same buffers and padded batches run without capture, and the setting falls back with one log
line."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from _architectures import make_tiny_model
from specdec_runtime.cloud_verifier.target.compiled_forward import CompiledForward
from specdec_runtime.cloud_verifier.kv.forward_row import ForwardRow
from specdec_runtime.cloud_verifier.target.runner import TargetRunner

TOL = 1e-4  # relative to the largest eager logit (float32)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SESSIONS, BLOCK, STEPS = 3, 4, 4  # verify rows per pass, tokens per row, passes (one compiled shape)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    return make_tiny_model("llama", tmp_path_factory.mktemp("compiled") / "llama", tokenizer)


def _runner(target_dir, mode="off"):
    return TargetRunner(target_dir, kv_cache_budget_tokens=2048, device=DEVICE, compile_mode=mode,
                        check_architecture=False)


def _target_only(runner: TargetRunner, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(runner.reference_logits(ids)[-1])))
    return ids[len(prompt):]


def _greedy_speculative(runner: TargetRunner, prompts: list[list[int]], truth: list[list[int]], eager=None):
    """Greedy speculative decoding of every prompt in lockstep, one batch of SESSIONS rows x BLOCK tokens per
    pass; the draft is target-only's continuation with one token per block made wrong (so acceptance and the
    recovered token both matter). Returns the generated ids per prompt and the largest logit difference to
    ``eager`` (the same passes on an eager runner) relative to its largest logit."""
    rng = np.random.default_rng(1)
    runners = [r for r in (runner, eager) if r is not None]
    kvs = [[r.allocate(len(p) + BLOCK * STEPS + 1) for p in prompts] for r in runners]
    for r, k in zip(runners, kvs):  # prefill all but the last prompt token (eager: records the plans)
        r.forward([ForwardRow(kv, p[:-1], 0, "none") for kv, p in zip(k, prompts)])
    out = [[] for _ in prompts]
    worst = 0.0
    for _ in range(STEPS):
        rows = [[], []]
        for i, p in enumerate(prompts):
            done = len(out[i])
            draft = list(truth[i][done : done + BLOCK - 1])
            draft[int(rng.integers(len(draft)))] = 5  # one wrong draft token
            block = [(p + out[i])[-1]] + draft
            for j, k in enumerate(kvs):
                rows[j].append(ForwardRow(k[i], block, len(p) - 1 + done, "all"))
        logits = runner.forward(rows[0])
        if eager is not None:
            ref = eager.forward(rows[1])
            scale = max(float(np.abs(x).max()) for x in ref)
            worst = max(worst, max(float(np.abs(a - b).max()) for a, b in zip(logits, ref)) / scale)
        for i, (row, lg) in enumerate(zip(rows[0], logits)):
            choice = lg.argmax(axis=1)  # target's greedy token after each prefix of the block
            accepted = 0
            while accepted < BLOCK - 1 and row.token_ids[1 + accepted] == choice[accepted]:
                accepted += 1
            out[i].extend(row.token_ids[1 : 1 + accepted] + [int(choice[accepted])])
    for r, k in zip(runners, kvs):
        for kv in k:
            r.free(kv)
    return out, worst


def _check(runner, eager):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 40000, 17 + 9 * i).tolist() for i in range(SESSIONS)]
    truth = [_target_only(eager, p, BLOCK * STEPS) for p in prompts]
    out, worst = _greedy_speculative(runner, prompts, truth, eager)
    assert worst < TOL
    for got, want in zip(out, truth):
        assert got == want[: len(got)] and len(got) >= STEPS


@pytest.mark.slow  # torch.compile: 41-104 s measured
def test_torch_compile_equals_eager_and_target_only(target_dir):
    import torch._dynamo.utils as du

    eager, compiled = _runner(target_dir), _runner(target_dir, "torch_compile")
    before = du.counters["stats"]["unique_graphs"]
    _check(compiled, eager)
    assert compiled._compiled.passes == STEPS  # every verify pass ran the compiled graph
    assert du.counters["stats"]["unique_graphs"] > before


def test_cuda_graph_buffers_and_padding_equal_eager(target_dir):
    """3 rows run as a bucket of 4 (one padding row in scratch blocks), key blocks padded to a power of two;
    captured on CUDA, replayed from the same static buffers without capture on the CPU."""
    eager, graphed = _runner(target_dir), _runner(target_dir)
    graphed._compiled = CompiledForward(graphed, "cuda_graphs", replay_eagerly=DEVICE == "cpu")
    _check(graphed, eager)
    assert graphed._compiled.passes == STEPS
    assert all(size == 4 for size, *_ in graphed._compiled.graphs)


def test_cuda_graphs_without_cuda_runs_eagerly_with_one_log_line(target_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="specdec_runtime.cloud_verifier.target.compiled_forward"):
        runner = _runner(target_dir, "cuda_graphs")
    lines = [r.message for r in caplog.records if "cuda_graphs" in r.message]
    if DEVICE == "cuda":  # on a GPU the setting is kept and nothing is logged
        assert runner._compiled.mode == "cuda_graphs" and lines == []
    else:
        assert runner._compiled.mode == "off"
        assert lines == ["compile mode cuda_graphs needs a CUDA device (this runner is on cpu): running eagerly"]


def test_unknown_compile_mode_is_refused(target_dir):
    with pytest.raises(ValueError, match="unknown compile mode 'jit'"):
        _runner(target_dir, "jit")
