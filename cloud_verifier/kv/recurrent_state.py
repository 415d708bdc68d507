"""Recurrent state of hybrid targets: the conv and SSM / linear-attention layers that hold no KV cache.

Hybrid models (LFM2's short convolutions, Qwen3-Next / Qwen3.5's gated delta rule, the Mamba2 mixers of Bamba,
Granite 4 hybrid, Nemotron-H, Falcon-H1) carry a fixed-size state per layer instead of keys and values: the conv
state (the last ``kernel`` inputs of a causal conv) and the recurrent state (no sequence axis). It cannot be
rolled back by dropping pages, so speculation needs the state after the accepted prefix of a block exactly.

How (docs/hybrid.md): every recurrent mixer module's ``forward`` is wrapped (:func:`install_row_mixers`). The
ragged batch (:class:`cloud_verifier.target.attention.PagedBatch`) lists each row's :class:`SessionState`; the wrapper
runs the HF mixer once per row on that row's slice of the flat sequence, starting from the session's own state,
so no state crosses from one session's row into the next. A session's state holds, per recurrent layer:

- ``committed``: the state at position ``position`` (c), never changed by a guess;
- ``end``: the state after the last row (positions c .. c + n - 1), from the row's own mixer call;
- ``inputs``: that row's mixer inputs [1, n, hidden].

The next row of the session starts at p, with c <= p <= c + n (the verifier starts it after the accepted
tokens). p == c + n takes ``end`` (every guess accepted, or the next prefill chunk); c < p < c + n replays the
first p - c stored inputs through the mixer on ``committed`` (exact by causality: the inputs of accepted positions
depend on accepted tokens only); p == c keeps ``committed``; p == 0 starts from zeros (a new prompt or a
rebuild from the committed ids). Anything else is a state this store does not hold: :meth:`SessionState.reaches`
says so before a forward pass (the scheduler then recomputes from position 0), and the wrapper raises
:class:`RecurrentStateError`.

The mixers' own code (their torch fallbacks: chunked scans, recurrent steps) runs unchanged: each gets a
:class:`LayerCache`, the subset of transformers' ``Cache`` API they call (``get_conv_state``,
``get_recurrent_state``, ``update_conv_state``, ``update_recurrent_state``, ``is_recording_past``, and since 5.25
``increase_count`` and ``get_recurrent_states_to_keep``) with the semantics of ``cache_utils.LinearAttentionLayer``
(transformers 5.24 and 5.25).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["RECURRENT_MIXERS", "LayerCache", "RecurrentStateError", "SessionState", "install_row_mixers"]

# HF modules that mix tokens through a conv / SSM / linear-attention state (transformers 5 names)
RECURRENT_MIXERS = frozenset({
    "Lfm2ShortConv", "Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "BambaMixer",
    "GraniteMoeHybridMambaLayer", "NemotronHMamba2Mixer", "FalconH1Mixer", "Mamba2Mixer",
})


class RecurrentStateError(ValueError):
    """A row starts at a position whose recurrent state the session does not hold (one line)."""


class LayerCache:
    """One layer's conv and recurrent state for one row (batch 1), with the ``Cache`` methods a mixer calls.

    ``conv``: [1, channels, kernel] or None (no state yet: a prefill from zeros); ``recurrent``: the mixer's
    state tensor (e.g. [1, heads, head_dim, d_state]) or None. The ``layer_idx`` / ``state_idx`` arguments are
    accepted and ignored: each instance is one layer's.
    """

    def __init__(self, conv: torch.Tensor | None = None, recurrent: torch.Tensor | None = None):
        self.conv = conv
        self.recurrent = recurrent

    def fork(self) -> LayerCache:
        """A copy a mixer may update in place (the single-token paths write into the given tensors)."""
        return LayerCache(None if self.conv is None else self.conv.clone(),
                          None if self.recurrent is None else self.recurrent.clone())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent) if t is not None)

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.recurrent

    def is_recording_past(self, layer_idx: int | None = None) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        # no intermediate states: a rejected tail is undone by replaying stored inputs, not by a state history
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        # transformers counts tokens here when a single-token path updates the conv state in place; the
        # positions of a row are the verifier's, so there is nothing to count
        return None

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, conv_kernel_size: int | None = None,
                          state_idx: int = 0, **kwargs) -> torch.Tensor:
        """``conv_states`` [1, channels, n] are the row's conv inputs. Returns the inputs with their left context
        (the held state before them, or zero padding up to the kernel when there is none), as
        ``LinearAttentionLayer.update_conv_state``; keeps the last ``conv_kernel_size`` of them."""
        kernel = int(conv_kernel_size or conv_states.shape[-1])
        if self.conv is None:
            full = conv_states
            if full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0), value=0)
        else:
            full = torch.cat([self.conv, conv_states], dim=-1)
        self.conv = full[..., -kernel:]
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int | None = None,
                               state_idx: int = 0, **kwargs) -> torch.Tensor:
        self.recurrent = recurrent_states
        return recurrent_states


class SessionState:
    """The recurrent state of one session (every recurrent layer), kept on its
    :class:`~cloud_verifier.kv.pool.SessionKV` as ``kv.recurrent``; see the module docstring.

    ``position``: c, the position ``committed`` is at; ``length``: n, the tokens of the last row (0: none).
    """

    def __init__(self):
        self.position = 0
        self.length = 0
        self.committed: dict[int, LayerCache] = {}
        self.end: dict[int, LayerCache] = {}
        self.inputs: dict[int, torch.Tensor] = {}

    def reaches(self, start: int) -> bool:
        """Whether a row may start at ``start``: 0, or c <= start <= c + n."""
        return start == 0 or self.position <= start <= self.position + self.length

    def advance(self, layer: int, start: int, mixer: Callable) -> LayerCache:
        """Layer ``layer``'s committed state moved to ``start`` (see the module docstring); ``mixer`` is the
        layer's unwrapped HF forward, for a replay. Returns a fork to run the row on.

        Raises:
            RecurrentStateError: ``start`` not reachable (:meth:`reaches`).
        """
        c, n = self.position, self.length
        if start == 0:
            self.committed[layer] = LayerCache()
        elif not c <= start <= c + n:
            raise RecurrentStateError(f"a row starts at position {start}, but the recurrent state is held for "
                                      f"positions {c}..{c + n} only (rebuild from position 0)")
        elif start == c + n and n:
            self.committed[layer] = self.end[layer]
        elif start > c:
            replayed = self.committed.get(layer, LayerCache()).fork()
            mixer(self.inputs[layer][:, : start - c], cache=replayed)
            self.committed[layer] = replayed
        return self.committed.setdefault(layer, LayerCache()).fork()

    def record(self, layer: int, inputs: torch.Tensor, end: LayerCache) -> None:
        """The row's mixer ``inputs`` [1, n, hidden] and the state ``end`` after it, for layer ``layer``."""
        self.inputs[layer] = inputs
        self.end[layer] = end

    def finish(self, start: int, n: int) -> None:
        """After every layer ran the row: committed is at ``start``, the row held ``n`` tokens."""
        self.position, self.length = int(start), int(n)

    @property
    def nbytes(self) -> int:
        """Bytes held: committed and end states, and the last row's inputs, over all layers."""
        states = sum(c.nbytes for c in self.committed.values()) + sum(c.nbytes for c in self.end.values())
        return states + sum(t.numel() * t.element_size() for t in self.inputs.values())


def _row_wise(module: torch.nn.Module, mixer: Callable) -> Callable:
    """``module``'s forward for the ragged batch: the HF ``mixer`` once per row, on that row's session state
    (``specdec_batch.recurrent``); outside the target runner (no ``specdec_batch``) the HF forward as it was."""
    layer = int(module.layer_idx)

    def forward(hidden_states: torch.Tensor, cache: Any = None, attention_mask: Any = None,
                specdec_batch: Any = None, **kwargs) -> torch.Tensor:  # [1, T, hidden] -> [1, T, hidden]
        if specdec_batch is None:
            return mixer(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        outputs = []
        for state, begin, n, start in specdec_batch.recurrent:
            row = hidden_states[:, begin : begin + n]
            run = state.advance(layer, start, mixer)
            outputs.append(mixer(row, cache=run))
            state.record(layer, row, run)
        return torch.cat(outputs, dim=1)

    return forward


def install_row_mixers(model: torch.nn.Module) -> list[int]:
    """Wrap the forward of every recurrent mixer of ``model`` (:data:`RECURRENT_MIXERS`) to run row by row on
    session states. Returns the wrapped layers' indices (empty: an attention-only model, nothing changed)."""
    layers = []
    for module in model.modules():
        if type(module).__name__ in RECURRENT_MIXERS:
            module.forward = _row_wise(module, module.forward)
            layers.append(int(module.layer_idx))
    return sorted(layers)
