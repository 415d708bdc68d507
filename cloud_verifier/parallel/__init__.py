"""Tensor parallelism of the target on torch.distributed: the verifier's forward sharded over N ranks.

- :mod:`~cloud_verifier.parallel.sharding`: Megatron-style cuts of the decoder layers (column-parallel q/k/v and
  gate/up, row-parallel o and down with one all-reduce each), the head plan, weight bytes.
- :mod:`~cloud_verifier.parallel.step`: rank 0 broadcasts each forward step's rows, positions and page tables;
  the other ranks run the same step on their shard.
- :mod:`~cloud_verifier.parallel.ranks`: starting the ranks (torch.multiprocessing, or torchrun), start-up
  status, failure watching, stop.

Rank 0 owns everything else (gRPC, sessions, batcher, verify policy, verdicts, the page allocator): the runner it
gets from :func:`start_from_settings` is a :class:`~cloud_verifier.target.runner.TargetRunner` whose decoder is
sharded and broadcasts, with ``runner.parallel`` (:class:`~cloud_verifier.parallel.ranks.ParallelRanks`).
"""

from __future__ import annotations

import os

from specdec_runtime.cloud_verifier.parallel.ranks import ParallelRanks, RankSpec, rank_spec, run_rank, start_parallel_runner
from specdec_runtime.cloud_verifier.parallel.sharding import TensorParallelError, plan_shards

# hybrid families whose recurrent mixers are sharded (sharding.CONV_MIXERS: LFM2's short convolutions, cut along
# their channels); the Mamba2 / gated-delta-rule mixers of the others are not
TP_HYBRID_MODEL_TYPES = ("lfm2",)

__all__ = ["TP_HYBRID_MODEL_TYPES", "ParallelRanks", "RankSpec", "TensorParallelError", "check_settings", "check_target", "is_torchrun_worker", "plan_shards",
           "rank_spec", "run_rank", "run_torchrun_worker", "start_from_settings", "start_parallel_runner"]


def check_settings(settings) -> None:
    """Refuse, before anything loads, the settings tensor parallelism does not support (one line).

    Raises:
        TensorParallelError: ``compile`` other than off (the compiled forward has no broadcast step), a hybrid
            target other than LFM2, or heads that cannot be split (:func:`check_target`).
        common.paths.ModelNotFoundError: the target directory is not a causal-LM directory.
    """
    from specdec_runtime.common.paths import default_model_paths, resolve_target_dir

    if settings.tensor_parallel <= 1:
        return
    if settings.compile != "off":
        raise TensorParallelError(f"--tensor-parallel {settings.tensor_parallel} runs the target eagerly: "
                                  f"compile={settings.compile} is not supported with it (use compile off)")
    check_target(str(resolve_target_dir(settings.target or default_model_paths().target_dir)), settings.tensor_parallel)


def is_torchrun_worker(settings) -> bool:
    """Whether this process is a torchrun rank > 0 of a tensor-parallel verifier (it serves no gRPC)."""
    return settings.tensor_parallel > 1 and "WORLD_SIZE" in os.environ and int(os.environ.get("RANK", "0")) > 0


def start_from_settings(settings):
    """Rank 0's tensor-parallel runner for :class:`cloud_verifier.config.VerifierSettings` (starts the ranks).

    Raises:
        TensorParallelError: an unsupported setting or target, or a rank failed to start (one line).
    """
    check_settings(settings)  # before any rank starts
    return start_parallel_runner(rank_spec(settings, settings.tensor_parallel))


def check_target(model_dir: str, world_size: int) -> None:
    """Refuse, from the config alone, a target tensor parallelism cannot cut ``world_size`` ways (one line).

    Raises:
        TensorParallelError: a hybrid (recurrent) target other than :data:`TP_HYBRID_MODEL_TYPES`, or heads that
            cannot be split (:func:`plan_shards`).
    """
    from transformers import AutoConfig

    from specdec_runtime.cloud_verifier.target.architectures import HYBRID_MODEL_TYPES

    config = AutoConfig.from_pretrained(model_dir)
    if not hasattr(config, "num_attention_heads"):  # a multimodal config: its text model's
        config = getattr(config, "text_config", config)
    if getattr(config, "model_type", None) in HYBRID_MODEL_TYPES and config.model_type not in TP_HYBRID_MODEL_TYPES:
        raise TensorParallelError(f"tensor parallel: hybrid (recurrent) target {config.model_type!r} is not "
                                  f"supported (hybrids: {', '.join(TP_HYBRID_MODEL_TYPES)}); use --tensor-parallel 1")
    plan_shards(config, world_size)


def run_torchrun_worker(settings) -> int:
    """A torchrun rank > 0: load its shard and serve steps until rank 0 stops. Returns the exit code."""
    check_settings(settings)
    return run_rank(rank_spec(settings, settings.tensor_parallel), int(os.environ["RANK"]))
