"""The target's hidden states a draft head asks for, taken from the forward pass the verifier runs anyway
(:mod:`common.features` has the contract): forward pre-hooks on the decoder layers record each asked layer's
input, the final normed state is the decoder's output. No extra forward pass, no change to the logits.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

__all__ = ["capture_layer_inputs", "row_features"]


@contextmanager
def capture_layer_inputs(decoder, layers: set[int]):
    """While inside, record the input hidden state [1, T, hidden_size] of every decoder layer in ``layers``
    (0 <= i < num_hidden_layers; the index num_hidden_layers is the caller's: the decoder's output). Yields the
    dict index → tensor, filled by the forward pass run inside."""
    captured: dict[int, torch.Tensor] = {}
    handles = []

    def hook_for(index: int):
        def hook(module, args, kwargs):
            captured[index] = args[0] if args else kwargs["hidden_states"]
        return hook

    try:
        for index in sorted(layers):
            if index < len(decoder.layers):
                handles.append(decoder.layers[index].register_forward_pre_hook(hook_for(index), with_kwargs=True))
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def row_features(captured: dict[int, torch.Tensor], last_hidden: torch.Tensor, num_layers: int,
                 layers: tuple[int, ...], begin: int, n: int):
    """float32 numpy [n, len(layers) x hidden_size]: positions begin .. begin + n - 1 of the flat batch, the
    asked layers concatenated in the asked order (``num_layers`` = the final normed state ``last_hidden``)."""
    parts = [(last_hidden if i == num_layers else captured[i])[0, begin : begin + n] for i in layers]
    return torch.cat(parts, dim=-1).float().cpu().numpy()
