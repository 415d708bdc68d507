"""Printing bench reports as rich tables (``specdec bench`` without ``--json``)."""

from __future__ import annotations

from .cells import fmt


def print_report(report: dict, console=None) -> None:
    """Print a bench report (from run_bench, run_clients_bench, run_gamma_sweep or run_edge_cloud_bench) as rich
    tables, then its notes."""
    from rich.console import Console

    if console is None:
        console = Console()
        console.width = max(console.width, 140)  # the tables are wide; piped output defaults to 80 columns
    if report.get("mode") == "drafts":
        _print_drafts(report, console)
    elif "replay" in report:
        from .replay import print_replay_report

        print_replay_report(report, console)
    elif "gamma_sweep" in report:
        _print_gamma_sweep(report, console)
    elif "edge_cloud" in report:
        _print_edge_cloud(report, console)
    elif "clients" in report:
        _print_clients(report, console)
    else:
        _print_spec_bench(report, console)
    for note in report.get("notes", []):
        console.print(f"[dim]note: {note}[/dim]")


def _print_drafts(report: dict, console) -> None:
    from rich.table import Table

    base, fwd = report["target_only"]["tokens_per_s"], report["target_forward_ms"]["1_token"]
    t = Table(title=f"Drafts side by side (greedy; target-only {fmt(base, '.1f')} tok/s, one-token forward "
                    f"{fmt(fwd, '.1f')} ms)")
    for col in ("draft", "γ", "acceptance", "τ", "per position", "draft ms/tok", "cost (run)", "cost c (step)",
                "tok/s", "speedup", "predicted", "identical"):
        t.add_column(col, justify="right")
    for name, d in report["drafts"].items():
        for mode in ("fixed", "adaptive"):
            m = d[mode]
            t.add_row(name, str(report["config"]["num_speculative_tokens"]) if mode == "fixed" else "adaptive",
                      fmt(m["acceptance_rate"], ".3f"), fmt(m["mean_accepted_length"]),
                      " ".join(fmt(a) for a in m["acceptance_per_position"]), fmt(m["draft_ms_per_token"]),
                      fmt(m["draft_cost_ratio"], ".3f"), fmt(d["draft_step_cost_ratio"], ".3f"),
                      fmt(m["tokens_per_s"], ".1f"),
                      fmt(m["speedup_vs_target_only"]), fmt(m["predicted_speedup"]),
                      "yes" if d["token_identical"] else "NO")
    console.print(t)


def _print_clients(report: dict, console) -> None:
    from rich.table import Table

    t = Table(title="Concurrent edge clients (one verifier, loopback gRPC)")
    for col in ("clients", "tok/s", "per-session tok/s", "mean batch", "serial tok/s", "speedup vs serial",
                "τ", "sessions", "tokens"):
        t.add_column(col, justify="right")
    for n, m in report["clients"].items():
        s = m.get("serial", {})
        t.add_row(n, fmt(m["tokens_per_s"], ".1f"), fmt(m["per_session_tokens_per_s"], ".1f"),
                  fmt(m["mean_batch_size"]), fmt(s.get("tokens_per_s"), ".1f"), fmt(m["speedup_vs_serial"]),
                  fmt(m.get("mean_accepted_length")), str(m.get("num_sessions", "")),
                  str(m.get("num_tokens", "")))
    console.print(t)


def _print_spec_bench(report: dict, console) -> None:
    from rich.table import Table

    t = Table(title="Spec-Bench: target-only vs specdec vs HF assisted (greedy)")
    cols = ("category", "n", "tokens", "accept", "τ", "tok/s target", "tok/s specdec", "tok/s HF",
            "× specdec", "× HF", "tgt ms/tok target", "tgt ms/tok specdec")
    for c in cols:
        t.add_column(c, justify="left" if c == "category" else "right")

    def row(name: str, m: dict, style: str | None = None):
        tps, sp, tm = m["tokens_per_s"], m["speedup_vs_target_only"], m["target_ms_per_token"]
        t.add_row(
            name, str(m["num_prompts"]), str(m["num_tokens"]), fmt(m["acceptance_rate"]),
            fmt(m["mean_accepted_length"]), fmt(tps["target_only"], ".1f"), fmt(tps["specdec"], ".1f"),
            fmt(tps["hf_assisted"], ".1f"), fmt(sp["specdec"]), fmt(sp["hf_assisted"]),
            fmt(tm["target_only"], ".1f"), fmt(tm["specdec"], ".1f"), style=style,
        )

    for name, m in report.get("categories", {}).items():
        row(name, m)
    row("overall", report["overall"], style="bold")
    console.print(t)
    o = report["overall"]
    fwd = o.get("target_forward_ms") or {}
    console.print(
        f"draft {fmt(o.get('draft_ms_per_token'))} ms/drafted token; draft cost ratio c = "
        f"{fmt(o.get('draft_cost_ratio'), '.3f')}; target forward "
        + ", ".join(f"{k.replace('_', ' ')}: {v:.1f} ms" for k, v in fwd.items())
        + (f"; HF assisted τ ≈ {fmt(o.get('hf_assisted_mean_accepted_length'))}"
           if o.get("hf_assisted_mean_accepted_length") is not None else "")
    )
    for key, a in (report.get("greedy_agreement") or {}).items():
        diffs = f" (first diffs: {[m['first_diff'] for m in a['mismatches']]})" if a["mismatches"] else ""
        console.print(f"greedy {key.replace('_', ' ')}: {a['identical']}/{a['of']} identical{diffs}")
    for key, a in (report.get("sampled_reproducibility") or {}).items():
        console.print(f"sampled {key.replace('_', ' ')} with the same seed again: {a['identical']}/{a['of']} identical")


def _print_gamma_sweep(report: dict, console) -> None:
    from rich.table import Table

    base = report["target_only"]["overall"]
    t = Table(title="γ sweep: speculative decoding vs target-only (greedy, in-process verifier)")
    for col in ("variant", "accept", "τ", "block", "draft ms/tok", "draft cost", "tgt ms/tok", "tok/s", "speedup"):
        t.add_column(col, justify="left" if col == "variant" else "right")
    t.add_row("target-only", "", "1.00", "0", "", "", fmt(base["target_ms_per_token"], ".1f"),
              fmt(base["tokens_per_s"], ".1f"), "1.00", style="dim")
    for name, mm in report["gamma_sweep"].items():
        m = mm["overall"]
        t.add_row(
            f"γ={name}" if name.isdigit() else name, fmt(m["acceptance_rate"]), fmt(m["mean_accepted_length"]),
            fmt(m["mean_block_tokens"]), fmt(m["draft_ms_per_token"], ".1f"), fmt(m["draft_cost_ratio"], ".3f"),
            fmt(m["target_ms_per_token"], ".1f"), fmt(m["tokens_per_s"], ".1f"),
            fmt(m["speedup_vs_target_only"]), style="bold" if not name.isdigit() else None,
        )
    console.print(t)
    cats = list(report["target_only"]["categories"])
    c = Table(title="speedup over target-only per category (acceptance rate in brackets)")
    c.add_column("variant")
    for cat in cats:
        c.add_column(cat, justify="right")
    for name, mm in report["gamma_sweep"].items():
        cells = []
        for cat in cats:
            m = mm["categories"].get(cat, {})
            cells.append(f"{fmt(m.get('speedup_vs_target_only'))} ({fmt(m.get('acceptance_rate'))})")
        c.add_row(f"γ={name}" if name.isdigit() else name, *cells)
    console.print(c)
    cfg = report["config"]
    mb = cfg.get("microbench_ms", {})
    console.print(
        f"target one-token forward in the run {fmt(base.get('target_forward_ms_1_token'), '.1f')} ms; microbench: "
        f"target {fmt(mb.get('target_forward_1_token'), '.1f')} ms, "
        f"draft {fmt(mb.get('draft_forward_1_token'), '.1f')} ms (ratio {fmt(mb.get('draft_cost_ratio'), '.3f')})"
    )
    ok = {k: f"{a['identical']}/{a['of']}" for k, a in (report.get("greedy_agreement") or {}).items()}
    console.print(f"greedy identical to target-only: {ok}")
    if cfg.get("plot"):
        console.print(f"plot: {cfg['plot']}")


def _print_edge_cloud(report: dict, console) -> None:
    from rich.table import Table

    t = Table(title="Edge–cloud: verifier process vs edge client on separate cores (loopback gRPC + simulated delay)")
    for col in ("delay ms", "variant", "tok/s", "× cloud-only", "× streaming model", "accept", "τ", "block",
                "proactive hits", "tgt ms/tok", "draft ms/tok", "tokens"):
        t.add_column(col, justify="left" if col in ("variant",) else "right")
    for d, entry in report["edge_cloud"].items():
        for v, m in entry.items():
            t.add_row(
                d, v, fmt(m["tokens_per_s"], ".1f"), fmt(m["ratio_vs_cloud_only"]),
                fmt(m.get("ratio_vs_streaming_model")) if v != "cloud_only" else
                (f"({fmt(m.get('streaming_model_tokens_per_s'), '.1f')} tok/s)"
                 if m.get("streaming_model_tokens_per_s") else "—"),
                fmt(m["acceptance_rate"]) if v != "cloud_only" else "", fmt(m["mean_accepted_length"]),
                fmt(m["mean_block_tokens"]), f"{m['proactive_hits']} ({fmt(m['proactive_hit_rate'])})"
                if v == "specdec_proactive" else "", fmt(m["target_ms_per_token"], ".1f"),
                fmt(m["draft_ms_per_token"], ".1f"), str(m["num_tokens"]),
                style="bold" if v == "specdec_proactive" else None,
            )
    console.print(t)
    cfg = report["config"]
    pin = cfg.get("pinning", {})
    console.print(
        f"edge core {pin.get('edge_core')} (seen {pin.get('edge_affinity_seen')}), verifier core "
        f"{pin.get('verifier_core')} (seen {pin.get('verifier_affinity_seen')}, "
        f"via {pin.get('verifier_pinned_with')}); "
        f"draft one-token forward {fmt(cfg.get('draft_forward_1_token_ms'), '.1f')} ms vs target "
        f"{fmt(cfg.get('target_forward_1_token_ms'), '.1f')} ms (ratio {fmt(cfg.get('draft_cost_ratio'), '.3f')})"
    )
    bad = {k: a for k, a in (report.get("greedy_agreement") or {}).items() if a["mismatches"]}
    console.print("greedy outputs identical across all variants and delays" if not bad else f"greedy MISMATCH: {bad}")
