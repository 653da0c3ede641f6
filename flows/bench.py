"""`grom bench`: every method side by side on the same target model and data, in one process.

Times and memory are measured around the library calls (no orchestration overhead) in the same process, so the
ratios are meaningful on a noisy machine; absolute seconds are not. Each method's edit is evaluated unquantized and
after the quantization attacks. Also measured: key-extraction throughput against a plain forward pass over the same
tokens, the solve's time against the matrix size, and the forward passes each method makes.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from flows.evaluation import build_benchmark, evaluate_spec, reference_path
from flows.workspace import Workspace
from grom_core.adapter import ModelAdapter
from grom_core.benchmarks.registry import get_benchmark
from grom_core.closed_form import GromParams, run_grom
from grom_core.data import make_batches
from grom_core.gradient.trainer import TrainerParams, unlearn_gradient
from grom_core.loading import load_model
from grom_core.profiling import measure
from grom_core.quantization import quantized, quantizers
from grom_core.solver import solve_edit
from grom_core.statistics import accumulate

log = logging.getLogger("grom.bench")

DEFAULT_METHODS = ("grom", "ga:sum", "npo:sum", "npo:sago", "simnpo:sum", "simnpo:sago")
FLAT = ("forget_rougeL_recall", "forget_quality", "model_utility", "forget_probability", "retain_probability")


def _evaluate(model, tokenizer, spec: dict, quants: dict) -> tuple[dict, dict]:
    metrics = evaluate_spec(model, tokenizer, spec)
    out = {}
    for name, q in quants.items():
        with quantized(model, q):
            out[name] = evaluate_spec(model, tokenizer, spec)
        out[name]["recovery_forget_rougeL_recall"] = out[name]["forget_rougeL_recall"] - metrics["forget_rougeL_recall"]
    return metrics, out


def key_extraction_throughput(model, batches, modules) -> dict:
    """Tokens per second of statistics accumulation (hooks, early stop) against plain forward passes."""
    tokens = sum(int(b.attention_mask.sum()) for b in batches)
    with torch.no_grad():
        start = time.perf_counter()
        for batch in batches:
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        plain = time.perf_counter() - start
    start = time.perf_counter()
    accumulate(model, batches, modules, early_stop=True)
    hooked = time.perf_counter() - start
    return {"tokens": tokens, "plain_forward_tokens_per_s": tokens / plain,
            "key_extraction_tokens_per_s": tokens / hooked, "key_extraction_over_forward": hooked / plain}


def solve_scaling(sizes=(128, 256, 512, 1024, 2048), s: int = 256, m: int = 256) -> list[dict]:
    """Seconds of solve_edit for n x n systems (float64 Cholesky): cubic in n once n dominates."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for n in sizes:
        x_f = torch.randn(n, s, generator=gen, dtype=torch.float64)
        x_r = torch.randn(n, 2 * n, generator=gen, dtype=torch.float64)
        gram = x_r @ x_r.T
        d = torch.randn(m, s, generator=gen, dtype=torch.float64)
        start = time.perf_counter()
        solve_edit(x_f, d, gram, 2 * n)
        rows.append({"n": n, "s": s, "m": m, "seconds": time.perf_counter() - start})
    return rows


def run_bench(home: str | None = None, benchmark: str = "minitofu", split: str | None = None,
              methods: tuple[str, ...] = DEFAULT_METHODS, quant_names: tuple[str, ...] = ("fp4", "nf4"),
              trainer: TrainerParams | None = None, authors: int | None = None) -> dict:
    """Run `methods` ("grom" or "method:compose") on the benchmark's target model; returns the table as `rows`."""
    trainer = trainer or TrainerParams()
    ws = Workspace.resolve(home)
    config = None
    if authors is not None and benchmark == "minitofu":
        from grom_core.benchmarks.minitofu import MiniTofuConfig

        config = MiniTofuConfig(authors=authors)
    built = build_benchmark(benchmark, None, str(ws.root), split, config=config)
    bench = get_benchmark(benchmark)
    splits = built.load_splits()
    forget, retain = bench.unlearning_inputs(splits, built.split)
    spec = {"benchmark": benchmark, "split": built.split, "reference": str(reference_path(built)),
            "splits": {k: str(v) for k, v in built.splits.items()}}
    available = quantizers()
    quants = {n: available[n] for n in quant_names if n in available}
    model, tokenizer = load_model(built.models["target"], device="cpu")
    before, _ = _evaluate(model, tokenizer, spec, {})
    rows = []
    grom_params = GromParams(**{**bench.grom_params, "influence": False})
    for entry in methods:
        method, _, compose = entry.partition(":")
        if method == "grom":
            with measure() as cold:
                run = run_grom(model, tokenizer, forget, retain, grom_params)
            with measure() as warm:
                cached = run_grom(model, tokenizer, forget, retain, grom_params, retain_stats=run.retain_stats)
            edit = cached.edit
            passes = 2 + 1 + (len(edit.modules) + 1)  # layer scores (forget, retain), retain stats, solve passes
            with edit.applied(model):
                metrics, qmetrics = _evaluate(model, tokenizer, spec, quants)
            for cost, is_cached in ((cold, False), (warm, True)):
                rows.append({"method": "grom", "compose": None, "cached_stats": is_cached, "seconds": cost.seconds,
                             "modules": edit.modules,
                             "peak_rss_mb": cost.peak_rss_mb, "steps": 0,
                             "forward_passes": passes - (1 if is_cached else 0), "metrics": metrics,
                             "quantized": qmetrics})
        else:
            with measure() as cost:
                run = unlearn_gradient(model, tokenizer, forget, retain, method=method, compose=compose or "sum",
                                       trainer=trainer)
            with run.edit.applied(model):
                metrics, qmetrics = _evaluate(model, tokenizer, spec, quants)
            rows.append({"method": method, "compose": compose or "sum", "cached_stats": None,
                         "seconds": cost.seconds, "peak_rss_mb": cost.peak_rss_mb, "steps": run.steps,
                         "forward_passes": run.forward_passes, "metrics": metrics, "quantized": qmetrics})
        log.info("bench %s: %.2f s, %s", entry, rows[-1]["seconds"],
                 ", ".join(f"{k} {rows[-1]['metrics'][k]:.3g}" for k in FLAT if k in rows[-1]["metrics"]))
    base = next((r["seconds"] for r in rows if r["method"] == "grom" and not r["cached_stats"]), None)
    for row in rows:
        row["time_ratio_to_closed_form"] = row["seconds"] / base if base else None
    forget_batches = make_batches(tokenizer, [_as_example(r) for r in forget], 16)
    edited = next((r["modules"] for r in rows if r.get("modules")), None)
    modules = [m for m in (edited or []) if m != "lm_head"] or [ModelAdapter.for_model(model).down_proj_names[-1]]
    throughput = key_extraction_throughput(model, make_batches(tokenizer, [_as_example(r) for r in retain], 16),
                                           modules)
    result = {"benchmark": benchmark, "split": built.split, "before": before, "rows": rows,
              "throughput": throughput, "solve_scaling": solve_scaling(),
              "forward_pass_floor": {"forget_tokens": sum(int(b.attention_mask.sum()) for b in forget_batches),
                                     "note": "one forward pass over the forget tokens is the least any method needs"},
              "quantizers": list(quants), "trainer": trainer.__dict__}
    plot = ws.root / "bench" / f"pareto-{benchmark}-{built.split}.png"
    result["plot"] = str(pareto_plot(rows, plot))
    result["mlflow"] = log_bench(ws.root, result)
    return result


def _as_example(row: dict):
    from grom_core.data import as_examples

    return as_examples([row])[0]


def pareto_plot(rows: list[dict], path: Path) -> Path:
    """Forget Quality (log) against Model Utility, marker area by unlearning time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    longest = max(r["seconds"] for r in rows) or 1.0
    for row in rows:
        if row["method"] == "grom" and row["cached_stats"]:
            continue
        fq = row["metrics"].get("forget_quality") or 1e-30
        label = row["method"] + (f"+{row['compose']}" if row["compose"] else "")
        ax.scatter(row["metrics"].get("model_utility", 0), fq, s=40 + 400 * row["seconds"] / longest, alpha=0.6,
                   label=f"{label} ({row['seconds']:.1f} s)")
    ax.set_yscale("log")
    ax.set_xlabel("Model Utility")
    ax.set_ylabel("Forget Quality (KS p-value)")
    ax.set_title("Unlearning methods: marker size = unlearning time")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def log_bench(root: Path, result: dict) -> dict:
    """One parent MLflow run with a child run per method."""
    import mlflow

    from tasks.tracking import configure

    configure(root)
    with mlflow.start_run(run_name=f"bench-{result['benchmark']}-{result['split']}") as parent:
        mlflow.log_params({"benchmark": result["benchmark"], "split": result["split"],
                           "quantizers": ",".join(result["quantizers"])})
        mlflow.log_metrics({f"throughput.{k}": v for k, v in result["throughput"].items()})
        mlflow.log_artifact(result["plot"], artifact_path="plots")
        children = []
        for row in result["rows"]:
            name = row["method"] + (f"+{row['compose']}" if row["compose"] else "")
            name += "-cached" if row["cached_stats"] else ""
            with mlflow.start_run(run_name=name, nested=True) as child:
                mlflow.log_params({"method": row["method"], "compose": row["compose"],
                                   "cached_stats": row["cached_stats"]})
                numbers = {k: v for k, v in row["metrics"].items() if isinstance(v, int | float)}
                for q, m in row["quantized"].items():
                    numbers.update({f"{q}.{k}": v for k, v in m.items() if isinstance(v, int | float)})
                numbers.update({"seconds": row["seconds"], "peak_rss_mb": row["peak_rss_mb"], "steps": row["steps"]})
                mlflow.log_metrics(numbers)
                children.append(child.info.run_id)
    return {"run_id": parent.info.run_id, "children": children}
