"""specdec: edge–cloud speculative decoding. This module is the public API; everything else is internal.

    from specdec import EdgeClient, EmbeddedServer

    with EmbeddedServer() as address:                      # a verifier in this process (specdec-edgecloud[verifier])
        with EdgeClient.connect(address) as client:        # the default prepared ONNX draft
            print(client.generate("Why is the sky blue?", max_new_tokens=64).text)

Names are imported on first use (PEP 562 module ``__getattr__``), so ``import specdec`` and the edge names work on
the slim edge install (``specdec-edgecloud[edge]``: no torch, no transformers); a cloud name there raises ImportError
naming the extra and how to install it (from a clone or a built wheel: :mod:`specdec.distribution`). Each name's own docstring is its reference (``help(specdec.EdgeClient)``).

Edge (the core install):

- :class:`EdgeClient` — the SDK client: drafts on the device, verifies through a verifier, streams committed text
  (``connect``, ``stream``, ``stream_chunks``, ``generate``, ``chat``).
- :class:`Conversation` — a multi-turn chat that keeps its verifier session and KV caches (``EdgeClient.chat()``).
- :class:`GenerationResult` — what a generation returns (text, token ids, finish reason, ``stats``, logprobs);
  :class:`GenerationStats` its counters (acceptance rate, mean accepted length); :class:`Chunk` a streamed piece
  of text and whether it was verified; :class:`FinishReason` why it ended; :class:`TokenLogprobs` one token's
  log-probability and alternatives.
- :class:`SamplingParams`, :class:`StoppingCriteria` — the checked parameters of one generation (the SDK builds
  them from its keyword options); :class:`GrammarSpec` — structured output (JSON schema, regex, choice, grammar).
- :class:`RetryPolicy` — retries and failover across verifiers; :class:`ModelPaths`, :func:`default_model_paths`
  — where the prepared models live.
- Drafting: :class:`Drafter` (the protocol), :class:`ModelDrafter` (an ONNX draft model), :class:`NgramDrafter`
  (prompt lookup, no model).

Cloud (``specdec-edgecloud[verifier]``: torch, transformers):

- :class:`Verifier` — the batched lossless verifier over a :class:`TargetRunner` (the target model);
  :class:`VerifierSettings` — its configuration (``SPECDEC_*`` environment variables).
- :class:`EmbeddedServer` — a real gRPC verifier server on 127.0.0.1 in a background thread;
  :class:`LocalBackend` — direct calls into an in-process verifier, no network.

Errors (one line each; each maps to one gRPC status code): :class:`SpecdecError` and its subclasses
:class:`InvalidRequestError`, :class:`ContextLengthError`, :class:`SessionNotFoundError`,
:class:`PreconditionError`, :class:`ConflictError`, :class:`CapacityError`, :class:`RateLimitedError`,
:class:`VerifierUnavailableError`, :class:`DeadlineError`, :class:`UnauthenticatedError`; and
:class:`ModelNotFoundError` (no model at a path), :class:`VocabMismatchError` (draft and target tokenizers
differ).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the module that defines it
_EDGE = {
    "EdgeClient": "specdec_runtime.edge_client.client",
    "Conversation": "specdec_runtime.edge_client.conversation",
    "GenerationResult": "specdec_runtime.edge_client.generation.run",
    "GenerationStats": "specdec_runtime.edge_client.stats",
    "Chunk": "specdec_runtime.edge_client.output",
    "FinishReason": "specdec_runtime.common.types",
    "TokenLogprobs": "specdec_runtime.common.types",
    "SamplingParams": "specdec_runtime.common.types",
    "StoppingCriteria": "specdec_runtime.common.types",
    "GrammarSpec": "specdec_runtime.common.grammar",
    "RetryPolicy": "specdec_runtime.edge_client.transport.retry",
    "ModelPaths": "specdec_runtime.common.paths",
    "default_model_paths": "specdec_runtime.common.paths",
    "Drafter": "specdec_runtime.edge_client.drafting.drafter",
    "ModelDrafter": "specdec_runtime.edge_client.drafting.drafter",
    "NgramDrafter": "specdec_runtime.edge_client.drafting.ngram",
}
_CLOUD = {
    "Verifier": "specdec_runtime.cloud_verifier.verifier",
    "TargetRunner": "specdec_runtime.cloud_verifier.target.runner",
    "VerifierSettings": "specdec_runtime.cloud_verifier.config",
    "EmbeddedServer": "specdec.embedded",
    "LocalBackend": "specdec.embedded",
}
_ERRORS = {name: "specdec_runtime.common.errors" for name in (
    "SpecdecError", "InvalidRequestError", "ContextLengthError", "SessionNotFoundError", "PreconditionError",
    "ConflictError", "CapacityError", "RateLimitedError", "VerifierUnavailableError", "DeadlineError",
    "UnauthenticatedError")}
_ERRORS.update(ModelNotFoundError="specdec_runtime.common.paths", VocabMismatchError="specdec_runtime.common.vocab")
_HOMES = {**_EDGE, **_CLOUD, **_ERRORS}

__all__ = [*_EDGE, *_CLOUD, *_ERRORS, "__version__"]


def __getattr__(name: str):
    """Import a public name on first use and keep it (PEP 562). Raises AttributeError for other names, and
    ImportError naming specdec-edgecloud[verifier] for a cloud name where the verifier's packages are not installed.
    ``__version__``: the installed distribution's version."""
    if name == "__version__":
        from specdec.distribution import version

        return version() or "0+unknown"  # a source tree that is not installed
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    try:
        module = importlib.import_module(home)
    except ModuleNotFoundError as e:
        if name not in _CLOUD:
            raise
        from specdec.distribution import install_command

        raise ImportError(f"specdec.{name} needs specdec-edgecloud[verifier] ({e.name} not installed): "
                          f"{install_command('verifier')}", name=e.name) from e
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from specdec_runtime.cloud_verifier.config import VerifierSettings
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec_runtime.common.errors import (CapacityError, ConflictError, ContextLengthError, DeadlineError, InvalidRequestError,
                               PreconditionError, RateLimitedError, SessionNotFoundError, SpecdecError,
                               UnauthenticatedError, VerifierUnavailableError)
    from specdec_runtime.common.grammar import GrammarSpec
    from specdec_runtime.common.paths import ModelNotFoundError, ModelPaths, default_model_paths
    from specdec_runtime.common.types import FinishReason, SamplingParams, StoppingCriteria, TokenLogprobs
    from specdec_runtime.common.vocab import VocabMismatchError
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.conversation import Conversation
    from specdec_runtime.edge_client.drafting.drafter import Drafter, ModelDrafter
    from specdec_runtime.edge_client.generation.run import GenerationResult
    from specdec_runtime.edge_client.drafting.ngram import NgramDrafter
    from specdec_runtime.edge_client.output import Chunk
    from specdec_runtime.edge_client.transport.retry import RetryPolicy
    from specdec_runtime.edge_client.stats import GenerationStats
    from specdec.embedded import EmbeddedServer, LocalBackend
