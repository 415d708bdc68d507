"""Fixtures shared by the end-to-end modules: the tiny model of each architecture (tests/_architectures.py) with
its ONNX draft, made once per test session. Several modules use the same tiny Qwen2 or LFM2 pair; each built and
exported its own copy (an export is ~3 s with torch.onnx, ~18 s with GenAI's builder subprocess, on 2 busy
cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from _architectures import HYBRIDS, make_sibling_draft, make_tiny_model


class ArchModels:
    """arch -> (HF dir, ONNX fp32 draft dir), built on first use. The draft of an attention-only architecture is
    the model's own export (``builder="auto"``: GenAI where its builder handles the architecture, as a user's
    export); a hybrid's is a sibling tiny Llama sharing its embeddings and LM head (``make_sibling_draft``),
    exported by torch.onnx: the hybrid tests check the verifier's recurrent state, and GenAI's Llama graph is
    covered by the llama case."""

    def __init__(self, root: Path, tokenizer) -> None:
        self.root = root
        self.tokenizer = tokenizer
        self._hf: dict[str, Path] = {}
        self._onnx: dict[str, Path] = {}
        self._siblings: dict[str, Path] = {}

    def __call__(self, arch: str, export: bool = True) -> tuple[Path, Path | None]:
        """(HF dir, ONNX draft dir); the draft is None (and not built) when ``export`` is False."""
        if arch not in self._hf:
            self._hf[arch] = make_tiny_model(arch, self.root / arch, self.tokenizer)
        if not export:
            return self._hf[arch], None
        if arch not in self._onnx:
            from specdec.models import export_onnx_draft

            source, builder = self._hf[arch], "auto"
            if arch in HYBRIDS:
                source, builder = self.sibling(arch), "torch"
            self._onnx[arch] = export_onnx_draft(source, self.root / f"{arch}-onnx", quantize_int8=False,
                                                 progress=False, builder=builder)
        return self._hf[arch], self._onnx[arch]

    def sibling(self, arch: str) -> Path:
        """HF dir of a hybrid's sibling Llama draft (the source of its ONNX draft)."""
        if arch not in self._siblings:
            self._siblings[arch] = make_sibling_draft(self(arch, export=False)[0], self.root / f"{arch}-draft",
                                                      self.tokenizer)
        return self._siblings[arch]


@pytest.fixture(scope="session")
def arch_models(tmp_path_factory, smollm2_tokenizer_dir) -> ArchModels:
    """The tiny models of tests/_architectures.py and their drafts, cached for the session (see ArchModels)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    return ArchModels(tmp_path_factory.mktemp("architectures"), tokenizer)
