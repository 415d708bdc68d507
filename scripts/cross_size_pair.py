#!/usr/bin/env python3
"""A real cross-size pair, made reproducibly: a layer-pruned, distilled copy of the target as its ONNX draft, measured.

The draft keeps ``--layers`` of the target's decoder layers (default 10 of SmolLM2-135M's 30: the first 5 and the
last 5, :func:`specdec.distill.front_back_layer_ids`), initialised from the target's weights, with the target's
embedding, final norm and head. Untrained (``--distill-s 0``) it is deterministic but poor. With ``--distill-s S``
it is trained by ``specdec draft distill``'s recipe (DistillSpec, Zhou et al. 2024: forward KL to the target's
top-32 softmax at temperature 1 on the target's own greedy continuations of ``../shared/prompts/train_prompts.jsonl``
only; FR-Spec head vocabulary, Zhao et al. 2025): ``--data-shards`` shards of 128 train prompts (at most
``--prompt-tokens`` tokens, ``--gen-tokens`` greedy tokens each, teacher top-k stored once), then ``--steps``
AdamW steps of ``--batch-tokens`` padded tokens (cosine schedule over the steps, peak ``--lr``), one torch thread,
seed 0, checkpoints every 2 minutes (a run cut short by the ``S`` s cap still exports its last state). Everything
is built once under ``--out`` (delete it to rebuild; never committed).
The draft is exported int8 like the prepared self-draft (``--fp32`` for fp32), then ``specdec bench``'s offline
harness (:func:`specdec.bench.offline.run_bench`, greedy, HF assisted off) measures acceptance rate, mean
accepted length τ and speedup vs target-only on the held-out prompts shipped in ``specdec/data/``, for this draft
and for the prepared int8 self-draft, side by side in one process. Prints one JSON object (``--json-out`` too).

    python3 scripts/cross_size_pair.py --out /tmp/pruned-pair --distill-s 0 --limit 2 --max-new-tokens 32  # untrained
    python3 scripts/cross_size_pair.py --out /tmp/pair-run --distill-s 1500 --limit 26 --max-new-tokens 96

Raises (as one ``error:`` line, exit 2): a target or self-draft that is not prepared, ``--layers`` out of range.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = ROOT / "specdec" / "data" / "spec_bench_dev.jsonl"  # the held-out (development) half
TRAIN_PROMPTS = ROOT.parent / "shared" / "prompts" / "train_prompts.jsonl"


def prune_target(target_dir: Path, out_dir: Path, layer_ids: list[int]) -> Path:
    """Save a copy of the HF model in ``target_dir`` with only the decoder layers ``layer_ids`` into ``out_dir``.

    Embedding, final norm and LM head are the target's (tied as in the target). Each kept layer's attention
    ``layer_idx`` is renumbered so the KV cache is indexed 0..len-1. Returns ``out_dir``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    layers = model.model.layers
    model.model.layers = torch.nn.ModuleList([layers[i] for i in layer_ids])
    for new_idx, layer in enumerate(model.model.layers):
        if hasattr(layer.self_attn, "layer_idx"):
            layer.self_attn.layer_idx = new_idx
    model.config.num_hidden_layers = len(layer_ids)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in layer_ids]
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(target_dir).save_pretrained(out_dir)
    (out_dir / "pruned_from.json").write_text(json.dumps({"target": str(target_dir), "layer_ids": layer_ids}))
    return out_dir


def distill_recipe(args: argparse.Namespace) -> dict:
    """The ``specdec.distill.distill`` settings of ``--distill-s`` (one torch thread, seeded, step-scheduled)."""
    return {"num_layers": args.layers, "time_budget_s": args.distill_s, "max_steps": args.steps,
            "data_time_budget_s": args.data_s, "data_max_shards": args.data_shards,
            "max_new_tokens": args.gen_tokens, "max_prompt_tokens": args.prompt_tokens, "lr": args.lr,
            "batch_tokens": args.batch_tokens, "head_vocab": args.head_vocab, "topk": 32, "threads": 1,
            "seed": 0, "gen_batch_size": 32, "gen_dtype": "bfloat16", "eval_every_s": 300.0,
            "ckpt_every_s": 120.0}


def build_draft(target_dir: Path, out: Path, args: argparse.Namespace) -> tuple[Path, dict]:
    """The pruned (optionally distilled) draft's ONNX directory and a description of how it was made.

    Raises:
        ValueError: ``--layers`` out of 1..num_target_layers-1.
    """
    from specdec.distill import front_back_layer_ids
    from specdec.models import export_onnx_draft, is_complete

    num_layers, int8 = args.layers, not args.fp32
    num_target_layers = json.loads((target_dir / "config.json").read_text())["num_hidden_layers"]
    if not 1 <= num_layers < num_target_layers:
        raise ValueError(f"--layers must be in 1..{num_target_layers - 1} (the target has {num_target_layers})")
    layer_ids = front_back_layer_ids(num_target_layers, num_layers)
    made = {"layer_ids": layer_ids, "target_layers": num_target_layers, "int8": int8, "distill_s": args.distill_s}
    t0 = time.perf_counter()
    if args.distill_s > 0:
        from specdec.distill import distill

        recipe = distill_recipe(args)
        run_dir = out / f"distill-{num_layers}l"
        onnx_dir = run_dir / "onnx"
        if is_complete(onnx_dir) and (run_dir / "distill_report.json").is_file():  # built once; delete to rebuild
            made["distill_report"] = json.loads((run_dir / "distill_report.json").read_text())
        else:
            made["distill_report"] = distill(target_dir, run_dir, train_prompts=args.train_prompts,
                                             init_layer_ids=layer_ids, quantize_int8=int8, progress=False, **recipe)
        made["recipe"] = recipe
    else:
        onnx_dir = out / (f"pruned-{num_layers}l-onnx-int8" if int8 else f"pruned-{num_layers}l-onnx")
        if not is_complete(onnx_dir):  # built once; delete --out to rebuild
            hf_dir = prune_target(target_dir, out / f"pruned-{num_layers}l-hf", layer_ids)
            export_onnx_draft(hf_dir, onnx_dir, quantize_int8=int8, progress=False)
    made["build_s"] = round(time.perf_counter() - t0, 1)
    return onnx_dir, made


def _summary(report: dict) -> dict:
    """The numbers that compare drafts: overall and per category."""
    keys = ("acceptance_rate", "mean_accepted_length", "speedup_vs_target_only", "tokens_per_s",
            "draft_ms_per_token", "draft_cost_ratio", "draft_top1_agreement", "num_prompts", "num_tokens")

    def pick(m: dict) -> dict:
        return {k: m[k] for k in keys if k in m}

    return {"overall": pick(report["overall"]),
            "categories": {c: pick(m) for c, m in report["categories"].items()},
            "greedy_agreement": report.get("greedy_agreement")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="where the pruned model and its ONNX draft go")
    ap.add_argument("--layers", type=int, default=10, help="decoder layers the draft keeps")
    ap.add_argument("--distill-s", type=float, default=0.0,
                    help="distill the pruned draft, at most this many s of training (0 = untrained)")
    ap.add_argument("--steps", type=int, default=120, help="training steps (the LR schedule runs over them)")
    ap.add_argument("--data-s", type=float, default=540.0, help="at most this long generating target data, s")
    ap.add_argument("--data-shards", type=int, default=6, help="target-data shards (128 prompts; held-out first)")
    ap.add_argument("--gen-tokens", type=int, default=64, help="target greedy continuation per train prompt")
    ap.add_argument("--prompt-tokens", type=int, default=192, help="train prompts longer than this are left out")
    ap.add_argument("--lr", type=float, default=3e-4, help="AdamW peak learning rate (cosine)")
    ap.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per training step")
    ap.add_argument("--head-vocab", type=int, default=16384, help="FR-Spec head vocabulary of the draft")
    ap.add_argument("--json-out", type=Path, help="also write the JSON object here")
    ap.add_argument("--fp32", action="store_true", help="export the draft in fp32 (default int8, as the self-draft)")
    ap.add_argument("--limit", type=int, default=8, help="prompts per run (held-out set, all categories)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("-g", "--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--no-self-draft", action="store_true", help="skip the int8 self-draft comparison run")
    ap.add_argument("--train-prompts", type=Path, default=TRAIN_PROMPTS,
                    help="JSONL of training prompts for --distill-s (default: the workspace's shared file)")
    args = ap.parse_args(argv)
    if args.distill_s > 0 and not args.train_prompts.is_file():
        print(f"error: no training prompts at {args.train_prompts}: pass --train-prompts FILE (one JSON object "
              "per line, as ../shared/prompts/train_prompts.jsonl)", file=sys.stderr)
        return 2

    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")  # distill's progress
    from specdec_runtime.common.paths import default_model_paths
    from specdec.bench.offline import run_bench
    from specdec.models import is_complete

    paths = default_model_paths()
    if not (is_complete(paths.target_dir) and is_complete(paths.draft_dir)):
        print(f"error: the default pair is not prepared ({paths.target_dir}): run `specdec models prepare`",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        draft_dir, made = build_draft(paths.target_dir, args.out, args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    drafts = {"pruned": draft_dir} if args.no_self_draft else {"pruned": draft_dir, "int8_self": paths.draft_dir}
    result = {"target": str(paths.target_dir), "draft": {"pruned": str(draft_dir), **made},
              "config": {"prompts": str(PROMPTS), "limit": args.limit, "max_new_tokens": args.max_new_tokens,
                         "num_speculative_tokens": args.num_speculative_tokens}, "results": {}}
    for name, d in drafts.items():
        report = run_bench(PROMPTS, limit=args.limit, max_new_tokens=args.max_new_tokens,
                           num_speculative_tokens=args.num_speculative_tokens, target=paths.target_dir, draft=d,
                           hf_assisted=False)
        result["results"][name] = _summary(report)
    text = json.dumps(result, indent=2, default=str)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
