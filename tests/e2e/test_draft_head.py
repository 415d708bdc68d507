"""A draft head fed by the verifier's hidden states (edge_client/drafting/head.py), converted from tiny random
EAGLE-3 and EAGLE-1 checkpoints in their authors' layouts (tests/_heads.py → specdec/models/head_export.py),
drafting over a real gRPC verifier: greedy output token-identical to target-only; the head reads the verifier's
features at the right positions (its draft equals the converted torch head run on HF's own hidden states); the
ONNX graph equals the torch one across KV-cache chunks; a head trained for another target is refused in one line.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _heads import write_eagle1, write_eagle3
from _reference import hf_greedy
from specdec.embedded import EmbeddedServer
from specdec.models.head_export import HeadMismatchError, export_head, load_head
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.common.types import SamplingParams
from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
from specdec_runtime.edge_client.drafting.head import HeadDrafter
from specdec_runtime.edge_client.drafting.head_model import OnnxHead
from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend

PROMPTS = ["Tell me a story about a robot.", "What is 2 + 2?"]
DRAFT_VOCAB = sorted(set(range(0, 49152, 61)) | set(range(200)))


@pytest.fixture(scope="module")
def heads(tiny_pair, tmp_path_factory):
    """kind → (checkpoint dir, converted head dir)."""
    root = tmp_path_factory.mktemp("heads")
    target = tiny_pair.target_dir
    e3 = write_eagle3(root / "eagle3-ckpt", target, DRAFT_VOCAB)
    e1 = write_eagle1(root / "eagle1-ckpt", target)
    return {"eagle3": (e3, export_head(target, e3, root / "eagle3")),
            "eagle1": (e1, export_head(target, e1, root / "eagle1"))}


@pytest.fixture(scope="module")
def runner(tiny_pair):
    return TargetRunner(tiny_pair.target_dir)


@pytest.mark.parametrize("kind,policy", [("eagle3", {}), ("eagle1", {"adaptive": True, "proactive": True})])
def test_greedy_over_grpc_is_target_only_and_reads_the_verifiers_features(kind, policy, heads, runner, tiny_pair):
    """Also with adaptive γ and proactive drafting (the head drafts past a block in flight on its own features)."""
    head = OnnxHead(heads[kind][1])
    drafter = HeadDrafter(head)
    with EmbeddedServer(verifier=Verifier(runner), grace_s=1.0) as address:
        with EdgeClient(GrpcBackend(address), drafter, head.tokenizer, num_speculative_tokens=4, **policy) as client:
            for prompt in PROMPTS:
                ids = encode_prompt(head.tokenizer, prompt)
                got = client.generate(prompt, max_new_tokens=20, ignore_eos=True)
                assert got.token_ids == hf_greedy(tiny_pair.target_dir, ids, 20), prompt
                assert got.stats.num_draft_tokens > 0
    committed = ids + list(got.token_ids)
    # every committed position but the last has the verifier's feature, and the head's entries use them
    assert drafter._target_features_for(committed) == len(committed) - 1
    # the head's next draft equals the torch head run on HF's own hidden states of the whole sequence
    loaded = load_head(tiny_pair.target_dir, heads[kind][0])
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_pair.target_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.model(torch.tensor([committed]), output_hidden_states=True)
        states = list(out.hidden_states[:-1]) + [out.last_hidden_state]
        layers = [len(states) - 1 if i == -1 else i for i in loaded.meta["feature_layers"]]
        f = torch.cat([states[i][0] for i in layers], dim=-1)[:-1]
        if loaded.fc_weight is not None:
            f = f @ loaded.fc_weight.float().T
        n = len(committed) - 1
        empty = torch.zeros(1, loaded.meta["num_key_value_heads"], 0, loaded.meta["head_dim"])
        logits = loaded.graph(torch.tensor([committed[1:]]), f[None], torch.arange(n)[None], empty, empty)[0][0, -1]
    want = int(logits.argmax()) if loaded.d2t is None else int(loaded.d2t[int(logits.argmax())])
    assert drafter.propose(committed, 1, SamplingParams()).draft_token_ids == [want]


def test_onnx_head_equals_the_torch_graph_across_kv_chunks(heads, tiny_pair):
    loaded = load_head(tiny_pair.target_dir, heads["eagle3"][0])
    head = OnnxHead(heads["eagle3"][1])
    rng = np.random.default_rng(0)
    ids = [int(t) for t in rng.integers(0, 49152, 9)]
    feats = rng.standard_normal((9, head.hidden_size)).astype(np.float32)
    first = head.forward(ids[:5], feats[:5])
    second = head.forward(ids[5:], feats[5:])
    empty = torch.zeros(1, loaded.meta["num_key_value_heads"], 0, loaded.meta["head_dim"])
    with torch.inference_mode():
        logits, hidden, _, _ = loaded.graph(torch.tensor([ids]), torch.from_numpy(feats)[None],
                                            torch.arange(9)[None], empty, empty)
    np.testing.assert_allclose(np.concatenate([first[0], second[0]]), logits[0].numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.concatenate([first[1], second[1]]), hidden[0].numpy(), rtol=1e-4, atol=1e-4)
    for name in ("tokenizer.json", "chat_template.jinja"):  # the device tokenizes (and templates) as the target
        assert (heads["eagle3"][1] / name).is_file() == (tiny_pair.target_dir / name).is_file(), name
    full = head.full_vocab_logits(second[0][-1])  # q is 0 outside the draft vocabulary
    assert np.isfinite(full).sum() == len(DRAFT_VOCAB) and np.isfinite(full[DRAFT_VOCAB]).all()


def test_a_head_for_another_target_is_refused_in_one_line(tiny_pair, tmp_path):
    wrong_width = write_eagle3(tmp_path / "wide", tiny_pair.target_dir, DRAFT_VOCAB, hidden=32)
    other_embedding = torch.randn(49152, 64)
    wrong_embedding = write_eagle3(tmp_path / "emb", tiny_pair.target_dir, DRAFT_VOCAB, embedding=other_embedding)
    for ckpt, what in ((wrong_width, "hidden size"), (wrong_embedding, "sha256")):
        with pytest.raises(HeadMismatchError, match=what) as info:
            export_head(tiny_pair.target_dir, ckpt, tmp_path / "out")
        assert "\n" not in str(info.value)
    from transformers import AutoModelForCausalLM

    own = AutoModelForCausalLM.from_pretrained(tiny_pair.target_dir).get_input_embeddings().weight.detach()
    ok = write_eagle3(tmp_path / "own", tiny_pair.target_dir, DRAFT_VOCAB, embedding=own)
    assert load_head(tiny_pair.target_dir, ok).meta["kind"] == "eagle3"  # its own embedding passes


def test_edge_install_drafts_with_the_head_without_torch(heads, runner, tiny_pair):
    """The slim [edge] install (tests/_edge_only.py blocks torch, transformers, the verifier) drafts with the head
    over gRPC, greedy-identical to target-only."""
    import json
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    with EmbeddedServer(verifier=Verifier(runner), grace_s=1.0) as address:
        code = textwrap.dedent(f"""
            import _edge_only, sys, json
            _edge_only.install()
            from specdec_runtime.edge_client.client import EdgeClient
            from specdec_runtime.edge_client.drafting.head import HeadDrafter
            from specdec_runtime.edge_client.drafting.head_model import OnnxHead
            from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
            head = OnnxHead({str(heads["eagle3"][1])!r})
            with EdgeClient(GrpcBackend({address!r}), HeadDrafter(head), head.tokenizer, num_speculative_tokens=4) as c:
                r = c.generate({PROMPTS[1]!r}, max_new_tokens=12, ignore_eos=True)
            print(json.dumps({{"ids": r.token_ids, "drafted": r.stats.num_draft_tokens,
                               "modules": sorted(_edge_only.root(m) for m in sys.modules)}}))
        """)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "tests"), str(root)])}
        proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                              timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not set(out["modules"]) & {"torch", "transformers", "cloud_verifier"}
    ids = encode_prompt(OnnxHead(heads["eagle3"][1]).tokenizer, PROMPTS[1])
    assert out["ids"] == hf_greedy(tiny_pair.target_dir, ids, 12) and out["drafted"] > 0


@pytest.mark.slow
def test_cli_export_head_refuses_another_targets_head_in_one_line(tiny_pair, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    ckpt = write_eagle3(tmp_path / "wide", tiny_pair.target_dir, DRAFT_VOCAB, hidden=32)
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "models", "export-head", str(tiny_pair.target_dir),
                           str(ckpt), str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: the head was not trained for this target"), lines


def test_a_gap_in_the_features_is_bridged_by_the_heads_own_and_later_features_are_used(heads):
    """Positions no answer covered (decoded in the cloud) get the head's own features for good; the target's
    features after the gap are used (the draft equals a step-by-step run of the same rule)."""
    from specdec_runtime.common.features import FLOAT16, encode_features

    rng = np.random.default_rng(1)
    committed = [int(t) for t in rng.integers(0, 49152, 20)]
    head = OnnxHead(heads["eagle3"][1])
    width = head.meta["target_feature_width"]
    vectors = rng.standard_normal((19, width)).astype(np.float32)
    known = [t < 8 or t >= 12 for t in range(19)]
    drafter = HeadDrafter(head)
    drafter.observe_features(committed[:9], encode_features(vectors[:8], 0, FLOAT16))
    drafter.propose(committed[:9], 3, SamplingParams())  # entries kept from before the gap
    drafter.observe_features(committed, encode_features(vectors[12:], 12, FLOAT16))
    got = drafter.propose(committed, 1, SamplingParams()).draft_token_ids
    ref = OnnxHead(heads["eagle3"][1])
    fused = ref.fuse(encode_features(vectors, 0, FLOAT16).decode())
    own = np.zeros(ref.hidden_size, np.float32)
    for t in range(19):
        logits, out = ref.forward([committed[t + 1]], (fused[t] if known[t] else own)[None])
        own = out[-1]
    assert got == [int(ref.draft_ids[int(logits[-1].argmax())])]


def test_generate_pipeline_takes_a_head_directory_as_the_draft(heads, tiny_pair):
    """`specdec generate --target T --draft HEAD_DIR` (the CLI's pipeline): a head directory drafts."""
    from specdec.cli.pipeline import build_pipeline

    client, close = build_pipeline(tiny_pair.target_dir, heads["eagle3"][1], server=None, in_process=False,
                                   target_only=False, draft_top_k=4, num_speculative_tokens=4, adaptive=False)
    try:
        assert isinstance(client.drafter, HeadDrafter)
        got = client.generate(PROMPTS[0], max_new_tokens=12, ignore_eos=True)
    finally:
        close()
    ids = encode_prompt(OnnxHead(heads["eagle3"][1]).tokenizer, PROMPTS[0])
    assert got.token_ids == hf_greedy(tiny_pair.target_dir, ids, 12) and got.stats.num_draft_tokens > 0


def test_a_head_is_published_delivered_and_drafts_as_a_head(heads, runner, tiny_pair, tmp_path):
    """A draft head folder published like a draft (kind "head"): the SDK fetches it (every file's sha256 checked)
    and loads it as a HeadDrafter; greedy output token-identical to target-only."""
    from specdec_runtime.cloud_verifier.drafts.catalog import DraftCatalog, publish_draft
    from specdec_runtime.common.draft_manifest import kind_of_folder

    root = tmp_path / "drafts"
    manifest = publish_draft(heads["eagle3"][1], root, "head", "1")
    assert manifest.kind == kind_of_folder(heads["eagle3"][1]) == "head"
    assert {"head.onnx", "head.json", "fuse.onnx", "d2t.npy", "tokenizer.json"} <= {f.path for f in manifest.files}
    catalog = DraftCatalog(root, rescan_interval_s=0.0)
    with EmbeddedServer(verifier=Verifier(runner), grace_s=1.0, drafts=catalog) as address:
        with EdgeClient.connect(address, delivery=True, draft_cache_dir=tmp_path / "cache",
                                num_speculative_tokens=4) as client:
            assert isinstance(client.drafter, HeadDrafter) and client.draft_version == ("head", "1")
            assert client.delivered.last_report.bytes_downloaded == manifest.size
            prompt = PROMPTS[0]
            got = client.generate(prompt, max_new_tokens=20, ignore_eos=True)
            ids = encode_prompt(client.tokenizer, prompt)
            assert got.token_ids == hf_greedy(tiny_pair.target_dir, ids, 20)
            assert got.stats.num_draft_tokens > 0  # the head drafted (a random head: its acceptance is ~0)
