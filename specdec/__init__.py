"""specdec: edge–cloud speculative decoding. This module is the public API; everything else is internal.

    from specdec import EdgeClient, EmbeddedServer

    with EmbeddedServer() as address:                      # a verifier in this process (specdec[verifier])
        with EdgeClient.connect(address) as client:        # the default prepared ONNX draft
            print(client.generate("Why is the sky blue?", max_new_tokens=64).text)

Names are imported on first use (PEP 562 module ``__getattr__``), so ``import specdec`` and the edge names work on
the slim ``pip install 'specdec[edge]'`` (no torch, no transformers); a cloud name there raises ImportError naming
the extra to install. Each name's own docstring is its reference (``help(specdec.EdgeClient)``).

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

Cloud (``specdec[verifier]``: torch, transformers):

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
    "EdgeClient": "edge_client.client",
    "Conversation": "edge_client.conversation",
    "GenerationResult": "edge_client.generation",
    "GenerationStats": "edge_client.stats",
    "Chunk": "edge_client.output",
    "FinishReason": "common.types",
    "TokenLogprobs": "common.types",
    "SamplingParams": "common.types",
    "StoppingCriteria": "common.types",
    "GrammarSpec": "common.grammar",
    "RetryPolicy": "edge_client.retry",
    "ModelPaths": "common.paths",
    "default_model_paths": "common.paths",
    "Drafter": "edge_client.drafter",
    "ModelDrafter": "edge_client.drafter",
    "NgramDrafter": "edge_client.ngram",
}
_CLOUD = {
    "Verifier": "cloud_verifier.verifier",
    "TargetRunner": "cloud_verifier.target",
    "VerifierSettings": "cloud_verifier.config",
    "EmbeddedServer": "specdec.embedded",
    "LocalBackend": "specdec.embedded",
}
_ERRORS = {name: "common.errors" for name in (
    "SpecdecError", "InvalidRequestError", "ContextLengthError", "SessionNotFoundError", "PreconditionError",
    "ConflictError", "CapacityError", "RateLimitedError", "VerifierUnavailableError", "DeadlineError",
    "UnauthenticatedError")}
_ERRORS.update(ModelNotFoundError="common.paths", VocabMismatchError="common.vocab")
_HOMES = {**_EDGE, **_CLOUD, **_ERRORS}

__all__ = [*_EDGE, *_CLOUD, *_ERRORS, "__version__"]


def __getattr__(name: str):
    """Import a public name on first use and keep it (PEP 562). Raises AttributeError for other names, and
    ImportError naming specdec[verifier] for a cloud name where the verifier's packages are not installed.
    ``__version__``: the installed distribution's version."""
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("specdec")
        except PackageNotFoundError:  # a source tree that is not installed
            return "0+unknown"
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    try:
        module = importlib.import_module(home)
    except ModuleNotFoundError as e:
        if name not in _CLOUD:
            raise
        raise ImportError(f"specdec.{name} needs specdec[verifier] ({e.name} not installed): "
                          f"pip install 'specdec[verifier]'", name=e.name) from e
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from cloud_verifier.config import VerifierSettings
    from cloud_verifier.target import TargetRunner
    from cloud_verifier.verifier import Verifier
    from common.errors import (CapacityError, ConflictError, ContextLengthError, DeadlineError, InvalidRequestError,
                               PreconditionError, RateLimitedError, SessionNotFoundError, SpecdecError,
                               UnauthenticatedError, VerifierUnavailableError)
    from common.grammar import GrammarSpec
    from common.paths import ModelNotFoundError, ModelPaths, default_model_paths
    from common.types import FinishReason, SamplingParams, StoppingCriteria, TokenLogprobs
    from common.vocab import VocabMismatchError
    from edge_client.client import EdgeClient
    from edge_client.conversation import Conversation
    from edge_client.drafter import Drafter, ModelDrafter
    from edge_client.generation import GenerationResult
    from edge_client.ngram import NgramDrafter
    from edge_client.output import Chunk
    from edge_client.retry import RetryPolicy
    from edge_client.stats import GenerationStats
    from specdec.embedded import EmbeddedServer, LocalBackend
