"""`grom bench`: every method side by side on the same target model and data, in one process.

Times and memory are measured around the library calls (no orchestration overhead) in the same process, so the
ratios are meaningful on a noisy machine; absolute seconds are not. Each method's edit is evaluated unquantized and
after the quantization attacks. Also measured: key-extraction throughput against a plain forward pass over the same
tokens, the solve's time against the matrix size, and the forward passes each method makes.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from flows.evaluation import build_benchmark, reference_path, sized_config
from flows.workspace import Workspace
from grom_core.adapter import ModelAdapter, weight_out_in
from grom_core.attacks import ATTACKS, AttackKit, RelearnRecipe, headline_recovery, recoveries
from grom_core.benchmarks.registry import Benchmark, get_benchmark
from grom_core.capture import model_device
from grom_core.data import as_examples, make_batches
from grom_core.errors import DataError
from grom_core.gradient.methods import TrainerParams
from grom_core.methods import DEFAULT_METHOD, Method, MethodContext, get_method
from grom_core.params import Params
from grom_core.profiling import measure
from grom_core.quantization import quantized, quantizers
from grom_core.solver import solve_edit
from grom_core.statistics import MemoryStatsStore, accumulate
from tasks.records import EvaluationSpec
from tasks.steps import evaluate_loaded, load_for_edit

log = logging.getLogger("grom.bench")

DEFAULT_METHODS = ("grom", "ga:sum", "npo:sum", "npo:sago", "simnpo:sum", "simnpo:sago")
DEFAULT_ATTACKS = ("fp4", "nf4", "head_swap", "logit_lens", "relearn")


def evaluate_with_attacks(model, tokenizer, spec: EvaluationSpec, quants: dict, forget_key: str,
                          kit: AttackKit | None = None, reading: Sequence[str] = ()) -> tuple[dict, dict]:
    """The model's metrics, and after each attack its metrics with "recovery_<metric>" (after the attack minus
    before it) and "recovery" (the headline one, `attacks.headline_recovery`): each quantization round trip of
    `quants` (name -> QuantSpec), then each attack in `reading` that reads around the edit (grom_core.attacks,
    run by `kit`)."""
    metrics = evaluate_loaded(model, tokenizer, spec)
    keys = (forget_key, *(kit.recovery if kit else ()))
    out = {}
    for name, q in quants.items():
        with quantized(model, q):
            out[name] = evaluate_loaded(model, tokenizer, spec)
        out[name].update(recoveries(out[name], metrics, keys))
        out[name]["recovery"] = headline_recovery(out[name], keys)
    for name in reading:
        out[name] = kit.run(name, model, tokenizer, metrics)
    return metrics, out


def attack_kit(model, tokenizer, spec: EvaluationSpec, bench: Benchmark, forget, retain,
               recipe: TrainerParams) -> AttackKit:
    """The attacks that read around an edit, for `model` as it is now (unedited: its head is the base head), on
    the benchmark's evaluation; the relearning attack at the gradient recipe's step size."""
    head = model.get_output_embeddings()
    return AttackKit(base_head=weight_out_in(head).detach().clone(), forget=as_examples(forget),
                     retain=as_examples(retain), evaluate=lambda: evaluate_loaded(model, tokenizer, spec),
                     recovery=(bench.metrics.forget, *bench.metrics.recovery), prompt_format=bench.prompt_format,
                     recipe=RelearnRecipe(lr=recipe.lr, seed=recipe.seed))


def split_attacks(names: Sequence[str]) -> tuple[dict, tuple[str, ...]]:
    """(quantization attacks that run here: name -> QuantSpec, attacks that read around the edit) of `names`; a
    name no machine knows is a DataError, one this machine cannot run (bitsandbytes missing) is left out with a
    warning."""
    known = quantizers(available=True)
    unknown = [n for n in names if n not in known and n not in ATTACKS]
    if unknown:
        raise DataError(f"no attack named {', '.join(map(repr, unknown))}; attacks: {', '.join([*known, *ATTACKS])}")
    here = quantizers()
    missing = [n for n in names if n in known and n not in here]
    if missing:
        log.warning("not run (bitsandbytes unavailable): %s", ", ".join(missing))
    names = list(dict.fromkeys(names))
    return {n: here[n] for n in names if n in here}, tuple(n for n in names if n in ATTACKS)


def parse_entry(entry: str, bench: Benchmark, trainer: dict | None = None) -> tuple[Method, Params, str]:
    """"method" or "method:compose" -> (registry entry, its parameters, the row label): the benchmark's parameters
    for the method; a gradient method gets the benchmark's recipe with `trainer` (TrainerParams fields) over it."""
    name, _, compose = entry.partition(":")
    method = get_method(name)
    values = bench.params_for(name, method.gradient)
    if compose:
        values["compose"] = compose
    if method.gradient and trainer:
        values["trainer"] = {**values.get("trainer", {}), **trainer}
    params = method.params.from_dict(values)
    if hasattr(params, "influence"):
        params = params.replace(influence=False)
    compose = getattr(params, "compose", None)
    return method, params, name + (f"+{compose}" if compose else "")


def plain_forward_seconds(model, batches) -> float:
    """Seconds of plain inference forward passes over `batches` (no hooks, no gradients)."""
    device = model_device(model)
    batches = [b.to(device) for b in batches]
    with torch.no_grad():
        synchronize(device)
        start = time.perf_counter()
        for batch in batches:
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        synchronize(device)
        return time.perf_counter() - start


def plain_step_seconds(model, tokenizer, forget, retain, recipe: TrainerParams, fmt: str, repeats: int = 3) -> float:
    """Seconds of one step of a plain training loop with the recipe (AdamW, the same batch size and clipping):
    forward and backward of a forget batch and of a retain batch (the causal-LM loss) and the optimizer step;
    what a gradient method's step cannot do with less. Mean of `repeats` steps on seeded batches; the weights are
    restored after."""
    device = model_device(model)
    order = random.Random(recipe.seed).sample(range(len(retain)), len(retain))
    forget_batches = make_batches(tokenizer, as_examples(forget), recipe.batch_size, recipe.max_length, fmt=fmt)
    retain_batches = make_batches(tokenizer, as_examples([retain[i] for i in order]), recipe.batch_size,
                                  recipe.max_length, fmt=fmt)
    params = list(model.parameters())
    saved = [p.detach().clone() for p in params]
    flags = [p.requires_grad for p in params]
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=recipe.weight_decay)
    for p in params:
        p.requires_grad_(True)
    try:
        synchronize(device)
        start = time.perf_counter()
        for step in range(repeats):
            for batch in (forget_batches[step % len(forget_batches)], retain_batches[step % len(retain_batches)]):
                batch = batch.to(device)
                model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels,
                      use_cache=False).loss.backward()
            torch.nn.utils.clip_grad_norm_(params, recipe.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        return (time.perf_counter() - start) / repeats
    finally:
        with torch.no_grad():
            for p, old, flag in zip(params, saved, flags, strict=True):
                p.copy_(old)
                p.requires_grad_(flag)


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a timer measures it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def key_extraction_throughput(model, batches, modules) -> dict:
    """Tokens per second of statistics accumulation (hooks, early stop) against plain forward passes."""
    tokens = sum(int(b.attention_mask.sum()) for b in batches)
    plain = plain_forward_seconds(model, batches)
    start = time.perf_counter()
    accumulate(model, batches, modules, early_stop=True)
    hooked = time.perf_counter() - start
    return {"tokens": tokens, "plain_forward_tokens_per_s": tokens / plain,
            "key_extraction_tokens_per_s": tokens / hooked, "key_extraction_over_forward": hooked / plain}


def solve_scaling(sizes=(128, 256, 512, 1024, 2048), s: int = 256, m: int = 256) -> list[dict]:
    """Seconds of solve_edit for n x n systems (float64 Cholesky): cubic in n once n dominates. Each row also
    says how exact the solve was: the norm of the objective's gradient at the solution, relative to that of its
    forget term at P = 0 (about 1e-12 in float64)."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for n in sizes:
        x_f = torch.randn(n, s, generator=gen, dtype=torch.float64)
        x_r = torch.randn(n, 2 * n, generator=gen, dtype=torch.float64)
        gram = x_r @ x_r.T
        d = torch.randn(m, s, generator=gen, dtype=torch.float64)
        start = time.perf_counter()
        p = solve_edit(x_f, d, gram, 2 * n)
        seconds = time.perf_counter() - start
        c = 1.0 / s  # the defaults: w_forget = w_retain = 1, ridge 1e-2
        gradient = p @ gram / (2 * n) + c * (p @ x_f - d) @ x_f.T + 1e-2 * p
        rows.append({"n": n, "s": s, "m": m, "seconds": seconds,
                     "relative_gradient": float(gradient.norm() / (c * d @ x_f.T).norm())})
    return rows


def run_bench(home: str | None = None, benchmark: str = "minitofu", split: str | None = None,
              methods: tuple[str, ...] = DEFAULT_METHODS, attacks: tuple[str, ...] = DEFAULT_ATTACKS,
              trainer: dict | None = None, authors: int | None = None,
              config: Mapping[str, object] | None = None) -> dict:
    """Run `methods` ("name" or "name:compose", names from the method registry) on the benchmark's target model;
    returns the table as `rows`, beside the unedited target's metrics (`before`) and, where the benchmark trains
    one, the retain model's (`retain_model`: the model that never saw the forget set, what unlearning aims at). A
    method that uses retain statistics is run twice: computing them, then with
    them cached (`cached_stats`). `attacks`: quantization round trips (grom_core.quantization) and attacks that read
    around the edit (grom_core.attacks.ATTACKS), each run on every method's edit: a row's "quantized" holds the
    first, its "attacks" both. `trainer`: TrainerParams fields over the benchmark's recipe for gradient methods;
    `config`: fields of the benchmark's configuration (a variant of its data, built apart)."""
    bench = get_benchmark(benchmark)
    entries = [parse_entry(e, bench, trainer) for e in methods]  # all checked before any work
    recipe = TrainerParams.from_dict({**bench.trainer, **(trainer or {})})
    ws = Workspace.resolve(home)
    built = build_benchmark(benchmark, None, str(ws.root), split, config=sized_config(benchmark, authors, config))
    forget, retain = built.unlearning_inputs()
    spec = EvaluationSpec(benchmark=benchmark, split=built.split, reference=str(reference_path(built)),
                          splits={k: str(v) for k, v in built.splits.items()})
    quants, reading = split_attacks(attacks)
    model, tokenizer = load_for_edit(str(built.models["target"]))  # a tied LM head is untied (a no-op)
    kit = attack_kit(model, tokenizer, spec, bench, forget, retain, recipe)
    before, _ = evaluate_with_attacks(model, tokenizer, spec, {}, bench.metrics.forget)
    rows = []
    for method, params, label in entries:
        store = MemoryStatsStore()
        context = MethodContext(stats_store=store, prompt_format=bench.prompt_format)
        with measure() as cost:
            run = method.run(model, tokenizer, forget, retain, params, context)
        costs = [(cost, False if run.retain_stats else None)]
        if run.retain_stats:
            with measure() as warm:
                run = method.run(model, tokenizer, forget, retain, params, context)
            costs.append((warm, True))
        with run.edit.applied(model):
            metrics, attacked = evaluate_with_attacks(model, tokenizer, spec, quants, bench.metrics.forget, kit,
                                                      reading)
        qmetrics = {name: attacked[name] for name in quants}
        for measured, cached in costs:
            rows.append({"method": method.name, "label": label, "compose": getattr(params, "compose", None),
                         "cached_stats": cached, "seconds": measured.seconds, "peak_rss_mb": measured.peak_rss_mb,
                         "modules": run.edit.modules, "steps": run.steps, "forward_passes": run.forward_passes,
                         "metrics": metrics, "quantized": qmetrics, "attacks": attacked})
        log.info("bench %s: %.2f s, %s", label, cost.seconds,
                 ", ".join(f"{k} {metrics[k]:.3g}" for k in bench.metrics.table if isinstance(metrics.get(k), float)))
    # the floor: one forward pass over the forget data and one over the retain data, the least a method that
    # looks at both can do (batched by length, the least padding), timed in this process beside the methods
    forget_batches = make_batches(tokenizer, as_examples(forget), 16, fmt=bench.prompt_format, by_length=True)
    retain_batches = make_batches(tokenizer, as_examples(retain), 16, fmt=bench.prompt_format, by_length=True)
    floor = {"forget_s": plain_forward_seconds(model, forget_batches),
             "retain_s": plain_forward_seconds(model, retain_batches),
             "forget_tokens": sum(int(b.attention_mask.sum()) for b in forget_batches),
             "retain_tokens": sum(int(b.attention_mask.sum()) for b in retain_batches)}
    floor_seconds = floor["forget_s"] + floor["retain_s"]
    if any(r["steps"] for r in rows):  # a gradient method's step against a plain training step
        floor["plain_step_s"] = plain_step_seconds(model, tokenizer, forget, retain, recipe, bench.prompt_format)
        for row in rows:
            if row["steps"]:
                row["step_ratio_to_plain"] = row["seconds"] / row["steps"] / floor["plain_step_s"]
    base = next((r["seconds"] for r in rows if r["method"] == DEFAULT_METHOD and not r["cached_stats"]), None)
    for row in rows:
        row["time_ratio_to_closed_form"] = row["seconds"] / base if base else None
        row["time_ratio_to_floor"] = row["seconds"] / floor_seconds
    edited = next((r["modules"] for r in rows if r["cached_stats"] is not None), None)
    adapter = ModelAdapter.for_model(model)
    modules = [m for m in (edited or []) if m != adapter.lm_head_name] or [adapter.down_proj_names[-1]]
    throughput = key_extraction_throughput(model, retain_batches, modules)
    result = {"benchmark": benchmark, "split": built.split, "before": before,
              "retain_model": built.checks.get("retain"), "rows": rows,
              "columns": list(bench.metrics.table[:bench.metrics.shown]), "throughput": throughput,
              "solve_scaling": solve_scaling(),
              "floor_seconds": floor_seconds, "floor": floor,
              "quantizers": list(quants), "attacks": [*quants, *reading], "trainer": recipe.to_dict(),
              "config": dict(config or {})}
    # the build's folder name carries its configuration's digest: a variant's plot does not replace the benchmark's
    plot = ws.root / "bench" / f"pareto-{built.root.name}-{built.split}.png"
    result["plot"] = str(pareto_plot(rows, plot, bench.metrics.utility, bench.metrics.forget))
    result["mlflow"] = log_bench(ws.root, result)
    return result


def pareto_plot(rows: list[dict], path: Path, utility: str, forget: str) -> Path:
    """The headline forget metric against the utility metric, marker area by unlearning time (the first,
    statistics-computing run of each method)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    longest = max(r["seconds"] for r in rows) or 1.0
    for row in rows:
        if row["cached_stats"]:
            continue
        ax.scatter(row["metrics"].get(utility) or 0.0, row["metrics"].get(forget) or 0.0,
                   s=40 + 400 * row["seconds"] / longest, alpha=0.6, label=f"{row['label']} ({row['seconds']:.1f} s)")
    ax.set_xlabel(f"{utility} (higher is better)")
    ax.set_ylabel(f"{forget} (lower is more forgotten)")
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
                           "attacks": ",".join(result["attacks"]),
                           **{f"config.{k}": v for k, v in result["config"].items()}})
        mlflow.log_metrics({f"throughput.{k}": v for k, v in result["throughput"].items()})
        mlflow.log_artifact(result["plot"], artifact_path="plots")
        children = []
        for row in result["rows"]:
            name = row["label"] + ("-cached" if row["cached_stats"] else "")
            with mlflow.start_run(run_name=name, nested=True) as child:
                mlflow.log_params({"method": row["method"], "compose": row["compose"],
                                   "cached_stats": row["cached_stats"]})
                numbers = {k: v for k, v in row["metrics"].items() if isinstance(v, int | float)}
                for q, m in row["attacks"].items():
                    numbers.update({f"{q}.{k}": v for k, v in m.items() if isinstance(v, int | float)})
                numbers.update({"seconds": row["seconds"], "peak_rss_mb": row["peak_rss_mb"], "steps": row["steps"]})
                mlflow.log_metrics(numbers)
                children.append(child.info.run_id)
    return {"run_id": parent.info.run_id, "children": children}
