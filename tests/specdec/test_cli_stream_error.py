"""`specdec generate` when the verifier refuses a request mid-answer: the text streamed so far stays on stdout and
the error's one line starts on a line of its own (stderr), not glued to the text. A real gRPC verifier of the tiny
pair refuses the third draft block (its token ids are outside the vocabulary: INVALID_ARGUMENT)."""

from __future__ import annotations

import pytest
import typer

pytestmark = pytest.mark.timeout(300)


def test_an_error_mid_answer_starts_on_its_own_line(tiny_pair, capsys):
    from specdec.cli.generate_command import _stream
    from specdec.embedded import EmbeddedServer
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend

    class RefusedThirdBlock(ModelDrafter):
        proposals = 0

        def propose(self, *args, **kwargs):
            block = super().propose(*args, **kwargs)
            self.proposals += 1
            if self.proposals == 3:  # ids past the vocabulary: the verifier refuses the block
                block.draft_token_ids = [10 ** 7] * max(len(block.draft_token_ids), 1)
            return block

    verifier = Verifier(TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=8192), max_batch_wait_ms=1.0)
    draft = OnnxDraftModel(tiny_pair.draft_dir)
    drafter = RefusedThirdBlock(draft)
    with EmbeddedServer(verifier=verifier, grace_s=1.0) as address, GrpcBackend(address) as backend:
        edge = EdgeClient(backend, drafter, draft.tokenizer, num_speculative_tokens=2, route="speculative")
        with pytest.raises(typer.Exit) as exit_:
            _stream(edge, lambda: None, "Once upon a time", False,
                    dict(max_new_tokens=40, temperature=0.0, ignore_eos=True, chat=False))
    out, err = capsys.readouterr()
    assert exit_.value.exit_code == 2 and drafter.proposals == 3
    assert out.strip(), "no text was streamed before the refused block"
    assert out.endswith("\n"), repr(out[-40:])
    assert err.splitlines()[-1].startswith("error: "), err
