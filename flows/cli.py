"""The `grom` command line. Logs go to stderr; with --json exactly one JSON object goes to stdout."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from flows import service_cli
from flows.console import (
    ConfigOpt,
    HomeOpt,
    JsonOpt,
    MethodOpt,
    Verbosity,
    before_after_table,
    emit,
    err,
    json_objects,
    json_option,
    key_values,
    quantization_table,
    setup_logging,
)
from flows.formatting import fmt
from flows.runtime import configure_process, quiet_libraries, set_threads, stop_on_sigterm
from grom_core.errors import DataError, GromError
from grom_core.methods import DEFAULT_METHOD, METHODS

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Retraining-free unlearning: a closed-form edit with exact per-example influence.")


@app.callback()
def _root(threads: Annotated[int | None, typer.Option(
        min=1, help="CPU threads torch may use (default: OMP_NUM_THREADS if set, else one per core). Beside another "
                    "busy process, fewer threads than cores is often faster.")] = None,
          verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log what every stage does, not only its "
                                                                       "summary line.")] = False) -> None:
    """Retraining-free unlearning: a closed-form edit with exact per-example influence."""
    set_threads(threads)
    Verbosity.detail = verbose
    quiet_libraries(verbose)


WorkersOpt = Annotated[int, typer.Option(min=0, help="Shard retain statistics over a local Dask cluster.")]
ComposeOpt = Annotated[str | None, typer.Option(help="Gradient composition of a gradient method: sum, pcgrad or sago "
                                                     "(sets its `compose` parameter).")]
ParamsOpt = Annotated[str | None, typer.Option(help='The method\'s parameters as JSON, e.g. {"retain_budget": 0.02}; '
                                                    'unknown names and wrong types are refused before any work.')]


def _method_params(params: str | None, compose: str | None = None, layers: str | None = None) -> dict:
    """--params JSON, with --compose and --layers folded in (the method's dataclass checks them all)."""
    values = json_option(params, "--params")
    if compose is not None:
        values["compose"] = compose
    if layers:
        try:
            values["layers"] = [int(x) for x in layers.split(",") if x.strip()]
        except ValueError as exc:
            raise DataError(f"--layers must be comma-separated integers, got '{layers}'") from exc
    return values
DaskOpt = Annotated[str | None, typer.Option(help="Existing Dask scheduler, e.g. tcp://host:8786.")]


@app.command()
def demo(
    home: Annotated[str | None, typer.Option(help="Workspace folder (default ./.grom or GROM_HOME).")] = None,
    benchmark: Annotated[str, typer.Option(help="Benchmark to build and unlearn.")] = "minitofu",
    split: Annotated[str | None, typer.Option(help="Forget split (default: the benchmark's, forget10).")] = None,
    authors: Annotated[int | None, typer.Option(min=10, help="minitofu size (default 50 authors).")] = None,
    method: MethodOpt = DEFAULT_METHOD,
    compose: ComposeOpt = None,
    params: ParamsOpt = None,
    quantization: Annotated[bool, typer.Option(help="Run the 4-/8-bit quantization recovery attack.")] = True,
    workers: WorkersOpt = 0,
    dask_address: DaskOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Build a benchmark (models cached), unlearn its forget split through the whole flow, show before/after."""
    from flows.demo import run_demo

    setup_logging(True)
    result = run_demo(home=home, benchmark=benchmark, split=split, workers=workers, dask_address=dask_address,
                      authors=authors, method=method, params=_method_params(params, compose),
                      quantization=quantization)
    emit(result, as_json, before_after_table(result), quantization_table(result))


@app.command()
def unlearn(
    model: Annotated[str, typer.Option(help="Model directory (save_pretrained, safetensors), or models:/NAME/VERSION "
                                            "or models:/NAME@serving from the workspace's registry.")],
    forget: Annotated[str, typer.Option(help="Forget data: JSON, JSONL, Parquet or CSV.")],
    retain: Annotated[str, typer.Option(help="Retain data, same formats.")],
    method: MethodOpt = DEFAULT_METHOD,
    compose: ComposeOpt = None,
    params: ParamsOpt = None,
    layers: Annotated[str | None, typer.Option(help="Comma-separated layers to edit (default: automatic).")] = None,
    model_name: Annotated[str | None, typer.Option(help="Registered model name in MLflow.")] = None,
    prompt_format: Annotated[str, typer.Option(help="How QA pairs become text: qa ('Question: ...\\nAnswer: ...' "
                                                    "and EOS, grom's tiny models), completion (the question is a "
                                                    "prefix the answer continues, no EOS: a pretrained base model) "
                                                    "or chat (the tokenizer's chat template).")] = "qa",
    quantization: Annotated[bool, typer.Option(help="Run the robustness checks: the quantization recovery attacks "
                                                    "(--quantizers) and the attacks that read around the edit "
                                                    "(--attacks).")] = False,
    quantizers: Annotated[str | None, typer.Option(help="Comma-separated quantization attacks to run (implies "
                                                        "--quantization; default with it: fp4,nf4): fp4, nf4, int8, "
                                                        "rtn4, gguf_q4_1, fp4_head_kept; '' for none.")] = None,
    attacks: Annotated[str | None, typer.Option(help="Comma-separated attacks that read around the edit (implies "
                                                     "--quantization; default with it: head_swap,logit_lens,"
                                                     "relearn): head_swap, logit_lens, relearn, relearn_retain; '' "
                                                     "for none.")] = None,
    home: Annotated[str | None, typer.Option(help="Workspace folder (default ./.grom or GROM_HOME).")] = None,
    max_examples: Annotated[int, typer.Option(min=1, help="How many forget and how many retain rows the evaluation "
                                                          "before and after the edit (and under each attack) "
                                                          "reads, at most.")] = 200,
    workers: WorkersOpt = 0,
    dask_address: DaskOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Unlearn your own forget data from your own model, keeping the retain data, and register the result."""
    from flows.demo import run_unlearn
    from tasks.records import EvaluationSettings

    values = _method_params(params, compose, layers)
    checks = None
    if quantization or quantizers is not None or attacks is not None:
        chosen = {k: list(_names(v)) for k, v in (("quantizers", quantizers), ("attacks", attacks)) if v is not None}
        checks = EvaluationSettings.from_dict(chosen)
    setup_logging(True)
    result = run_unlearn(model, forget, retain, home=home, params=values, model_name=model_name, workers=workers,
                         dask_address=dask_address, method=method, checks=checks, prompt_format=prompt_format,
                         max_examples=max_examples)
    emit(result, as_json, before_after_table(result), quantization_table(result))


benchmark_app = typer.Typer(no_args_is_help=True, help="Shipped benchmarks: build splits and models.")
app.add_typer(benchmark_app, name="benchmark")


@benchmark_app.command("list")
def benchmark_list(as_json: JsonOpt = False) -> None:
    """The registry's benchmarks: where each one's data and model come from, its forget splits and headline
    metrics."""
    from grom_core.benchmarks.registry import BENCHMARKS

    rows = [{"name": name,
             "data": ("probed from the model" if bench.pretrained else "generated") if bench.generate else (
                 "your files (--data-dir)"),
             "model": f"pretrained: {bench.pretrained}" if bench.pretrained else (
                 f"{bench.base} fine-tuned here" if bench.base else (
                     "tiny Llama trained here" if bench.training_rows else "yours")),
             "forget_splits": sorted(bench.forget_splits), "default_split": bench.default_split,
             "forget_metric": bench.metrics.forget, "utility_metric": bench.metrics.utility}
            for name, bench in BENCHMARKS.items()]
    table = Table(title="benchmarks")
    for column in ("benchmark", "data", "model", "forget splits (default)", "forget / utility metric"):
        table.add_column(column)
    for row in rows:
        splits = ", ".join(s if s != row["default_split"] else f"{s} (default)" for s in row["forget_splits"])
        table.add_row(row["name"], row["data"], row["model"], splits,
                      f"{row['forget_metric']} / {row['utility_metric']}")
    emit({"benchmarks": rows}, as_json, table)


@benchmark_app.command("build")
def benchmark_build(
    name: Annotated[str, typer.Argument(help="A benchmark that `grom benchmark list` shows as generated here.")],
    out: Annotated[str | None, typer.Option(help="Output folder (default <workspace>/benchmarks).")] = None,
    split: Annotated[str | None, typer.Option(help="Forget split the retain model leaves out.")] = None,
    check: Annotated[bool, typer.Option(help="Evaluate both models and save the retain reference.")] = True,
    config: ConfigOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Write the benchmark's splits (JSONL) and the split's unlearning inputs (what `grom unlearn` takes), and train
    its target and retain models (cached)."""
    from flows.evaluation import build_benchmark, sized_config

    setup_logging(True)
    built = build_benchmark(name, out, home, split, check=check,
                            config=sized_config(name, None, json_option(config, "--config")))
    forget, retain = built.unlearning_files()
    table = Table(title=f"{name} ({built.split})")
    table.add_column("item")
    table.add_column("path")
    for key, path in {**built.splits, "unlearning: forget": forget, "unlearning: retain": retain,
                      **{f"model: {k}": v for k, v in built.models.items()}}.items():
        table.add_row(key, str(path))
    for role, metrics in built.checks.items():
        for key, value in metrics.items():
            if isinstance(value, float):
                table.add_row(f"{role}: {key}", f"{value:.4g}")
    emit({**built.as_json(), "unlearning": {"forget": str(forget), "retain": str(retain)}}, as_json, table)


@app.command()
def evaluate(
    model: Annotated[str, typer.Option(help="Model directory (save_pretrained, safetensors).")],
    benchmark: Annotated[str, typer.Option(help="A benchmark of `grom benchmark list` (tofu: the real TOFU files, "
                                                "--data-dir).")],
    split: Annotated[str | None, typer.Option(help="Forget split (default: the benchmark's).")] = None,
    retain_reference: Annotated[str | None, typer.Option(help="Per-question values of the retain model.")] = None,
    save_reference: Annotated[str | None, typer.Option(help="Write this model's per-question values here.")] = None,
    data_dir: Annotated[str | None, typer.Option(help="Folder of the real TOFU files (--benchmark tofu).")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Generation length for ROUGE.")] = 200,
    batch_size: Annotated[int, typer.Option(min=1)] = 32,
    config: ConfigOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """All metrics of a benchmark (or of its variant, `--config`) for one model."""
    from flows.evaluation import evaluate_model

    setup_logging(True)
    result = evaluate_model(model, benchmark, split=split, reference=retain_reference,
                            save_reference=save_reference, data_dir=data_dir, home=home,
                            max_new_tokens=max_new_tokens, batch_size=batch_size,
                            config=json_option(config, "--config"))
    table = key_values(Table(title=f"{benchmark} {result['split']}: {model}"), result["metrics"], "metric")
    table.caption = f"n = {result['n']}, {result['seconds']:.1f} s"
    emit({k: v for k, v in result.items() if k != "per_question"} | {"per_question": result["per_question"]},
          as_json, table)


@app.command()
def finetune(
    data: Annotated[str, typer.Option(help="QA pairs or texts: JSON, JSONL, Parquet or CSV.")],
    out: Annotated[str, typer.Option(help="Output model directory.")],
    base: Annotated[str | None, typer.Option(help="Continue training this local checkpoint.")] = None,
    epochs: Annotated[int, typer.Option(min=1)] = 40,
    lr: Annotated[float, typer.Option(min=0.0)] = 3e-3,
    batch_size: Annotated[int, typer.Option(min=1)] = 16,
    seed: int = 0,
    hidden_size: Annotated[int, typer.Option(min=8, help="Tiny model width (without --base).")] = 128,
    layers: Annotated[int, typer.Option(min=1, help="Tiny model depth (without --base).")] = 4,
    vocab_size: Annotated[int, typer.Option(min=300, help="BPE vocabulary (without --base).")] = 600,
    as_json: JsonOpt = False,
) -> None:
    """Train a causal LM on QA pairs or raw text (a tiny Llama from scratch, or continue a local checkpoint)."""
    from flows.evaluation import finetune_command
    from grom_core.finetune import TinyModelConfig, TrainConfig

    setup_logging(True)
    train = TrainConfig(epochs=epochs, lr=lr, batch_size=batch_size, seed=seed)
    shape = TinyModelConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                            num_layers=layers)
    result = finetune_command(data, out, base, train, shape)
    emit(result, as_json, key_values(Table(title="finetune"), result))


@app.command("tofu-score")
def tofu_score(
    model_logs: Annotated[str, typer.Argument(help="eval_log_aggregated.json or TOFU_EVAL.json of the model.")],
    retain: Annotated[str, typer.Option(help="The same for the retain model.")],
    as_json: JsonOpt = False,
) -> None:
    """Forget Quality, Model Utility and its nine parts from TOFU evaluation logs."""
    from flows.evaluation import tofu_score_command

    setup_logging(False)
    result = tofu_score_command(model_logs, retain)
    emit(result, as_json, key_values(Table(title="TOFU"), result, "metric"))


@app.command()
def bench(
    benchmark: Annotated[str, typer.Option(help="Shipped benchmark.")] = "minitofu",
    split: Annotated[str | None, typer.Option(help="Forget split.")] = None,
    methods: Annotated[str | None, typer.Option(help="Comma-separated method[:compose] list; methods: " +
                                                     ", ".join(METHODS) + " (default grom,ga:sum,npo:sum,npo:sago,"
                                                     "simnpo:sum,simnpo:sago; with --scale, grom,npo).")] = None,
    attacks: Annotated[str | None, typer.Option(help="Comma-separated attacks: quantization round trips (fp4, nf4, "
                                                     "int8, rtn4, gguf_q4_1, fp4_head_kept) and attacks that read "
                                                     "around the edit (head_swap, logit_lens, relearn, "
                                                     "relearn_retain); default fp4,nf4,head_swap,logit_lens,relearn; "
                                                     "with --ablation, none.")] = None,
    quantizers: Annotated[str | None, typer.Option(help="The former name of --attacks.")] = None,
    epochs: Annotated[int | None, typer.Option(min=1, help="Epochs of the gradient methods (default: the "
                                                          "benchmark's recipe, TOFU's 10).")] = None,
    authors: Annotated[int | None, typer.Option(min=10, help="minitofu size (default 50 authors).")] = None,
    ablation: Annotated[bool, typer.Option(help="Instead of the methods: the closed form's design choices, one "
                                                "row each (flows/ablation.py).")] = False,
    rows: Annotated[str | None, typer.Option(help="With --ablation: comma-separated row names (default all).")] = None,
    params: Annotated[str | None, typer.Option(help="With --ablation: rows of your own, a JSON object of GromParams "
                                                    "fields (or a list of them), each changing the library "
                                                    "defaults; alone they replace the full list.")] = None,
    scale: Annotated[bool, typer.Option(help="Instead of a benchmark: each stage's seconds and peak memory of "
                                             "`grom unlearn`, `grom model materialize` and the revert on random "
                                             "models of Llama-3.2-1B's shape and around it (--shapes), and the "
                                             "cost's growth with width (docs/scale.md).")] = False,
    shapes: Annotated[str | None, typer.Option(help="With --scale: comma-separated shapes (default w512,w1024,"
                                                    "llama-3.2-1b,w2560).")] = None,
    config: ConfigOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Every method side by side on one target model: time, memory, quality, and quality after quantization."""
    from flows.bench import DEFAULT_ATTACKS, DEFAULT_METHODS, run_bench

    setup_logging(True)
    if scale:
        _scale_table(home, shapes, methods, attacks if attacks is not None else quantizers, as_json)
        return
    if shapes:
        raise DataError("--shapes chooses the scale benchmark's models: add --scale")
    methods = methods or ",".join(DEFAULT_METHODS)
    variant = json_option(config, "--config")
    own = json_objects(params, "--params")
    if attacks is not None and quantizers is not None:
        raise DataError("--quantizers is the former name of --attacks: give one of them")
    attacks = attacks if attacks is not None else quantizers
    if ablation:
        chosen = tuple(r.strip() for r in rows.split(",") if r.strip()) if rows else None
        _ablation_table(home, benchmark, split, authors, as_json, chosen, variant, own, _names(attacks or ""))
        return
    if own or rows:
        raise DataError("--rows and --params choose ablation rows: add --ablation (the methods' rows take each "
                        "benchmark's own parameters)")
    result = run_bench(home, benchmark, split, tuple(m.strip() for m in methods.split(",") if m.strip()),
                       DEFAULT_ATTACKS if attacks is None else _names(attacks),
                       {"epochs": epochs} if epochs else None, authors=authors, config=variant)
    table = Table(title=f"grom bench: {benchmark} {result['split']}")
    quants, columns = result["quantizers"], result["columns"]
    reading = [a for a in result["attacks"] if a not in quants]
    for column in ("method", "cached", "seconds", "x closed form", "x floor", "step x plain", "peak MB", *columns,
                   *[f"{q} {k}" for q in quants for k in columns], *[f"{a} recovery" for a in reading]):
        table.add_column(column)
    blank = [""] * (6 + len(quants) * len(columns) + len(reading))
    for label, metrics in (("unedited", result["before"]), ("retain model", result["retain_model"])):
        if metrics:
            table.add_row(label, *blank[:6], *[fmt(metrics.get(k)) for k in columns], *blank[6:])
    for row in result["rows"]:
        cells = [row["label"], fmt(row["cached_stats"]), f"{row['seconds']:.2f}",
                 fmt(row["time_ratio_to_closed_form"]), fmt(row["time_ratio_to_floor"]),
                 fmt(row.get("step_ratio_to_plain")), f"{row['peak_rss_mb']:.0f}",
                 *[fmt(row["metrics"].get(k)) for k in columns]]
        for q in quants:
            cells += [fmt(row["quantized"].get(q, {}).get(k)) for k in columns]
        cells += [fmt(row["attacks"].get(a, {}).get("recovery")) for a in reading]
        table.add_row(*cells)
    t = result["throughput"]
    table.caption = (f"floor (one forward pass over forget and retain data) {result['floor_seconds']:.2f} s; key "
                     f"extraction {t['key_extraction_over_forward']:.2f}x a plain forward pass; plot: {result['plot']}")
    emit(result, as_json, table)


def _scale_table(home: str | None, shapes: str | None, methods: str | None, attacks: str | None,
                 as_json: bool) -> None:
    from flows import scale

    result = scale.run_scale(home, _names(shapes) if shapes else scale.DEFAULT_SHAPES,
                             _names(methods) if methods else scale.DEFAULT_METHODS,
                             _names(attacks) if attacks is not None else scale.DEFAULT_ATTACKS)
    emit(result, as_json, *scale.tables(result))


def _names(listed: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in listed.split(",") if n.strip())


def _ablation_table(home: str | None, benchmark: str, split: str | None, authors: int | None, as_json: bool,
                    rows: tuple[str, ...] | None = None, config: Mapping[str, object] | None = None,
                    custom: Sequence[Mapping[str, object]] = (), attacks: tuple[str, ...] = ()) -> None:
    from flows.ablation import run_ablation

    result = run_ablation(home, benchmark, split, rows, authors=authors, config=config, custom=custom,
                          attacks=attacks)
    columns = result["columns"][:4]  # the headline metrics; --json has them all
    table = Table(title=f"grom bench --ablation: {benchmark} {result['split']}")
    for column in ("row", "seconds", "layers", "logit drop asked / got", "budget scale (damage)",
                   "forget target scale (probability)", *columns,
                   *[f"{q} recovery" for q in result["attacks"]]):
        table.add_column(column)
    table.add_row("unedited", "", "", "", "", "", *[fmt(result["before"].get(k)) for k in columns],
                  *["" for _ in result["attacks"]])
    for row in result["rows"]:
        drop, fit, aim = row["logit_drop"], row["scaling"]["budget"], row["scaling"]["forget_target"]
        drops = f"{drop['asked_mean']:.3g} / {drop['achieved_mean']:.3g}" if drop else ""
        budget = f"{fit['scale']:.3g} ({fit['damage']:.3f})" if fit else ""
        aimed = f"{aim['scale']:.3g} ({aim['probability']:.3g})" if aim else ""
        same = f" (same weights as {row['same_weights_as']})" if row["same_weights_as"] else ""
        table.add_row(row["name"] + same, f"{row['seconds']:.2f}", ",".join(map(str, row["layers"])), drops, budget,
                      aimed, *[fmt(row["metrics"].get(k)) for k in columns],
                      *[fmt(row["quantized"][q].get("recovery")) for q in result["attacks"]])
    emit(result, as_json, table)


service_cli.add_commands(app)  # model, request, audit, revert, serve


def main() -> None:
    """Entry point: user mistakes become one line on stderr and exit code 2, never a traceback."""
    configure_process()
    stop_on_sigterm()
    try:
        app()
    except GromError as exc:
        err.print(Text.assemble(("error:", "bold red"), " ", str(exc)), soft_wrap=True)
        sys.exit(2)
    except Exception as exc:
        full = disk_full(exc)
        if full is None:
            raise
        err.print(Text.assemble(("error:", "bold red"), " ", f"the disk is full ({full}); free some space (or "
                                f"give --home a folder on another disk) and run the command again: what this run "
                                f"registered is undone by the next one"), soft_wrap=True)
        sys.exit(2)


def disk_full(exc: BaseException) -> str | None:
    """What a full disk said, anywhere in the chain of `exc` (an OSError ENOSPC, SQLite's "database or disk is
    full" inside MLflow's and SQLAlchemy's wrappers, DuckDB's write error), or None for any other failure."""
    import errno

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return exc.strerror or "no space left on device"
        text = str(exc)
        for marker in ("database or disk is full", "No space left on device"):
            if marker in text:
                return marker
        exc = exc.__cause__ or exc.__context__
    return None


if __name__ == "__main__":
    main()
