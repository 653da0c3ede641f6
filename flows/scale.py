"""`grom bench --scale`: what every stage of a real run costs at the sizes users run, and how that cost grows.

For each shape (grom_core.benchmarks.scale: Llama-3.2-1B's and the same depth at other widths, random bfloat16
weights) and each method, the run is the product's own commands, each in a fresh process so that its peak memory
is its own: `grom unlearn` end to end (ingest, load, the method's stages, evaluation before and after, apply and
save, the influence audit, the attacks, registration in MLflow), `grom model materialize` of the registered
version (the parent's weights with the edit applied, checked against its fingerprint), and the exact revert of the
edit on those weights (checked against the base fingerprint). Each stage's seconds and peak resident memory come
from the run's own stage timer; each process's peak from the kernel (wait4). The growth with width is fitted per
stage (seconds ~ width^b, least squares in log-log), and the fit projects the stages to a larger shape.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from flows.workspace import Workspace
from grom_core.benchmarks.registry import write_jsonl
from grom_core.benchmarks.scale import PLANNED, ScaleShape, build_scale_model, get_shape, scale_data
from grom_core.errors import GromError

log = logging.getLogger("grom.scale")

DEFAULT_SHAPES = ("w512", "w1024", "llama-3.2-1b", "w2560")
DEFAULT_METHODS = ("grom", "npo")
DEFAULT_ATTACKS = ("fp4", "nf4", "head_swap", "logit_lens")
CLOSED_FORM_STAGES = ("plan", "retain_statistics", "retain_probe", "solve", "scale")
EVAL_EXAMPLES = 8  # forget and retain rows each evaluation reads: the cost of a stage, not a quality figure
# A random model has no margins to size GROM's drops by (the mean margin of its forget answers is 0, and the edit
# would be zero, its solve skipped): the benchmark asks a fixed drop instead, whose value no cost depends on.
METHOD_PARAMS = {"grom": {"specificity": {"beta": 3.0}}}


@dataclass(frozen=True)
class Child:
    """One command of the product run in its own process: its JSON result, wall seconds and peak resident MB."""

    payload: dict
    seconds: float
    peak_mb: float


@dataclass
class ScaleRow:
    """One (shape, method) run: each stage's seconds and peak MB, and the processes' own figures."""

    shape: str
    method: str
    parameters: int
    weights_mb: float
    stages_s: dict[str, float] = field(default_factory=dict)
    stages_peak_mb: dict[str, float] = field(default_factory=dict)
    unlearn_s: float = 0.0
    unlearn_peak_mb: float = 0.0
    edit_id: str = ""
    modules: tuple[str, ...] = ()
    error: str | None = None  # why a command of this run failed (the rows after it still run)
    forget_probability: tuple[float, float] | None = None  # (before, after): the edit did something

    def closed_form_s(self) -> float:
        return sum(self.stages_s.get(s, 0.0) for s in CLOSED_FORM_STAGES)


def run_child(args: Sequence[str], log_path: Path, module: str = "flows.cli") -> Child:
    """`python -m <module> <args>` in a fresh process; its stdout parsed as one JSON object, its stderr to
    `log_path`; a failure raises with the log's last lines.

    The peak is the child's own high-water mark (VmHWM of its address space after exec), read while it runs: the
    kernel's ru_maxrss of a forked child starts at the parent's resident size, so a large parent would inflate it."""
    out_path = log_path.with_suffix(".json")
    peak_kb = 0
    with open(out_path, "wb") as out, open(log_path, "ab") as err:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=out, stderr=err)
        while proc.poll() is None:
            peak_kb = max(peak_kb, _high_water_kb(proc.pid, module))
            time.sleep(0.1)
        seconds = time.perf_counter() - start
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-5:]
        raise GromError(f"`{module} {' '.join(args[:2])}` failed with exit code {proc.returncode}: "
                        + " | ".join(tail))
    return Child(payload=json.loads(out_path.read_text()), seconds=seconds, peak_mb=peak_kb / 1024)


def _high_water_kb(pid: int, module: str) -> int:
    """VmHWM of a running `python -m module` process in kB (0 before its exec, when it is still a copy of the
    parent, and once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            if b"-m\x00" + module.encode() not in handle.read():
                return 0
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def revert_check(model_dir: str, edit_dir: str) -> dict:
    """The edit reverted on the weights it was applied to (its undo, bit for bit), checked against the base
    fingerprint the edit was computed on."""
    from grom_core.edit import Edit, Undo
    from grom_core.fingerprint import weights_fingerprint
    from tasks.steps import load_for_edit

    model, _ = load_for_edit(model_dir)
    edit = Edit.load(edit_dir)
    edit.revert(model, Undo.load(Path(edit_dir) / "undo.safetensors"))
    fingerprint = weights_fingerprint(model)
    if fingerprint != edit.base_fingerprint:
        raise GromError(f"reverting edit {edit.edit_id} gave weights {fingerprint[:12]}, not the base "
                        f"{edit.base_fingerprint[:12]}")
    return {"edit_id": edit.edit_id, "fingerprint": fingerprint}


def run_scale(home: str | None = None, shapes: Sequence[str | ScaleShape] = DEFAULT_SHAPES,
              methods: Sequence[str] = DEFAULT_METHODS, attacks: Sequence[str] = DEFAULT_ATTACKS,
              eval_examples: int = EVAL_EXAMPLES, n_forget: int = 8, n_retain: int = 64,
              keep_runs: bool = False) -> dict:
    """Build (or reuse) each shape's random model and run every method on it through the product's commands;
    return the rows, the fitted growth and the projection of each stage to Llama-3-8B's shape.

    Each run's workspace holds three copies of its model (the edited one the flow saves, the registry's root
    version, the materialised one: 8 GB at the 1B shape); it is removed once measured unless `keep_runs`."""
    from grom_core.finetune import example_texts

    shapes = [s if isinstance(s, ScaleShape) else get_shape(s) for s in shapes]
    ws = Workspace.resolve(home)
    root = ws.root / "scale"
    forget, retain = scale_data(n_forget, n_retain)
    forget_path = str(write_jsonl(root / "data" / "forget.jsonl", [ex.record() for ex in forget]))
    retain_path = str(write_jsonl(root / "data" / "retain.jsonl", [ex.record() for ex in retain]))
    quantizers = [a for a in attacks if a not in _reading_attacks()]
    reading = [a for a in attacks if a in _reading_attacks()]
    rows: list[ScaleRow] = []
    rates = machine_rates()
    log.info("scale: this machine's bfloat16 products %.0f GFLOP/s, float64 Cholesky %.0f GFLOP/s",
             rates["bf16_matmul_gflops"], rates["fp64_cholesky_gflops"])
    for shape in shapes:
        start = time.perf_counter()
        model_dir = build_scale_model(shape, example_texts(forget + retain), root / "models")
        log.info("scale %s: %.2fB parameters, model ready in %.1f s", shape.name, shape.parameters() / 1e9,
                 time.perf_counter() - start)
        for method in methods:
            try:
                row = _run_one(ws, shape, method, str(model_dir), forget_path, retain_path, quantizers, reading,
                               eval_examples, root / "logs")
            except GromError as exc:  # out of memory, say: recorded, and the next run goes on
                log.warning("scale %s %s failed: %s", shape.name, method, exc)
                row = ScaleRow(shape=shape.name, method=method, parameters=shape.parameters(),
                               weights_mb=shape.weight_bytes() / 2**20, error=str(exc))
            rows.append(row)
            if not keep_runs:
                shutil.rmtree(root / "runs" / f"{shape.name}-{method}", ignore_errors=True)
            result = _result(rows, shapes, methods, ws, rates)
            (root / "results.json").write_text(json.dumps(result, indent=1))  # kept if a later run is stopped
    return result


def _result(rows: list[ScaleRow], shapes: Sequence[ScaleShape], methods: Sequence[str], ws: Workspace,
            rates: dict[str, float]) -> dict:
    growth = {m: fit_growth([r for r in rows if r.method == m and r.error is None], shapes) for m in methods}
    target = PLANNED["llama-3-8b"]
    projected = {}
    for method in methods:  # from the largest shape each method ran on
        done = [r for r in rows if r.method == method and r.error is None]
        if done and growth[method]:
            last = max(done, key=lambda r: _width(shapes, r.shape))
            base = next(s for s in shapes if s.name == last.shape)
            projected[method] = {"from": base.name, "to": target.name,
                                 "stages_s": project(last, growth[method], base, target)}
    return {"rows": [dataclasses.asdict(r) for r in rows], "growth": growth, "projected": projected,
            "machine": rates, "shapes": [dataclasses.asdict(s) for s in shapes], "workspace": str(ws.root)}


def _width(shapes: Sequence[ScaleShape], name: str) -> int:
    return next(s.hidden for s in shapes if s.name == name)


def machine_rates(n: int = 2048) -> dict[str, float]:
    """This machine's measured throughput, GFLOP/s: a bfloat16 matrix product (what the forward passes run) and a
    float64 Cholesky factorisation (what the solve runs), each the best of three, for turning projected seconds into
    operations and operations into another machine's seconds."""
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16)
    spd = torch.randn(n, n, dtype=torch.float64)
    spd = spd @ spd.T + n * torch.eye(n, dtype=torch.float64)
    best = {"bf16_matmul_gflops": 0.0, "fp64_cholesky_gflops": 0.0}
    for _ in range(3):
        start = time.perf_counter()
        a @ a
        best["bf16_matmul_gflops"] = max(best["bf16_matmul_gflops"], 2 * n ** 3 / (time.perf_counter() - start) / 1e9)
        start = time.perf_counter()
        torch.linalg.cholesky(spd)
        best["fp64_cholesky_gflops"] = max(best["fp64_cholesky_gflops"],
                                           n ** 3 / 3 / (time.perf_counter() - start) / 1e9)
    return best


def _reading_attacks() -> tuple[str, ...]:
    from grom_core.attacks import ATTACKS

    return tuple(ATTACKS)


def _run_one(ws: Workspace, shape: ScaleShape, method: str, model_dir: str, forget: str, retain: str,
             quantizers: list[str], reading: list[str], eval_examples: int, logs: Path) -> ScaleRow:
    """`grom unlearn`, `grom model materialize` and the revert of one method on one shape, in a workspace of their
    own, emptied first (so the retain statistics are computed, never read from an earlier run's cache)."""
    logs.mkdir(parents=True, exist_ok=True)
    name = f"scale-{shape.name}-{method}"
    tag = f"{shape.name}-{method}"
    home = ws.root / "scale" / "runs" / tag
    if home.exists():
        shutil.rmtree(home)
    for old in logs.glob(f"{tag}-*"):
        old.unlink()
    args = ["unlearn", "--model", model_dir, "--forget", forget, "--retain", retain, "--method", method,
            "--model-name", name, "--max-examples", str(eval_examples), "--home", str(home), "--json"]
    if method in METHOD_PARAMS:
        args += ["--params", json.dumps(METHOD_PARAMS[method])]
    if quantizers or reading:
        args += ["--quantizers", ",".join(quantizers), "--attacks", ",".join(reading)]
    unlearned = run_child(args, logs / f"{tag}-unlearn.log")
    result = unlearned.payload
    row = ScaleRow(shape=shape.name, method=method, parameters=shape.parameters(),
                   weights_mb=shape.weight_bytes() / 2**20, unlearn_s=unlearned.seconds,
                   unlearn_peak_mb=unlearned.peak_mb, edit_id=result["edit_id"], modules=tuple(result["modules"]))
    row.stages_s = {k: float(v) for k, v in result["timings_s"].items() if k not in ("unlearning", "total")}
    row.stages_peak_mb = {k: float(v) for k, v in result.get("stage_peak_mb", {}).items()}
    metrics = result["metrics"]
    row.forget_probability = (metrics["before"].get("forget_probability"),
                              metrics["after"].get("forget_probability"))
    version = str(result["mlflow"]["version"])
    out = home / "materialized"
    materialized = run_child(["model", "materialize", name, version, "--out", str(out), "--home", str(home),
                              "--json"], logs / f"{tag}-materialize.log")
    row.stages_s["materialize"], row.stages_peak_mb["materialize"] = materialized.seconds, materialized.peak_mb
    reverted = run_child(["revert", str(out), result["edit_dir"]], logs / f"{tag}-revert.log", module="flows.scale")
    row.stages_s["revert"], row.stages_peak_mb["revert"] = reverted.seconds, reverted.peak_mb
    log.info("scale %s %s: unlearn %.1f s (closed-form stages %.1f s), peak %.0f MB; materialize %.1f s, revert "
             "%.1f s", shape.name, method, row.unlearn_s, row.closed_form_s(), row.unlearn_peak_mb,
             materialized.seconds, reverted.seconds)
    return row


def fit_growth(rows: Sequence[ScaleRow], shapes: Sequence[ScaleShape]) -> dict[str, float]:
    """Per stage, the exponent b of seconds ~ width^b (least squares on the logs) over the rows' shapes; stages
    that ran on fewer than two shapes, or took no measurable time, are left out."""
    width = {s.name: s.hidden for s in shapes}
    stages = sorted({k for r in rows for k in r.stages_s})
    out = {}
    for stage in stages:
        points = [(math.log(width[r.shape]), math.log(r.stages_s[stage])) for r in rows
                  if r.stages_s.get(stage, 0.0) > 1e-3]
        if len({x for x, _ in points}) < 2:
            continue
        mx = sum(x for x, _ in points) / len(points)
        my = sum(y for _, y in points) / len(points)
        sxx = sum((x - mx) ** 2 for x, _ in points)
        out[stage] = sum((x - mx) * (y - my) for x, y in points) / sxx
    return out


def project(row: ScaleRow, growth: dict[str, float], base: ScaleShape, target: ScaleShape) -> dict[str, float]:
    """Each stage of `row` (measured on `base`) projected to `target`: times (width ratio)^b and the depth ratio,
    an upper bound for stages that do not run through every layer."""
    ratio, depth = target.hidden / base.hidden, target.layers / base.layers
    return {stage: seconds * ratio ** growth[stage] * depth for stage, seconds in row.stages_s.items()
            if stage in growth}


STAGE_ORDER = ("ingest", "load", *CLOSED_FORM_STAGES, "train", "unlearn", "evaluate_before", "apply_and_save",
               "influence", "evaluate_after", "quantization", "read_around", "register", "materialize", "revert")


def _stages(rows: Sequence[dict]) -> list[str]:
    seen = {k for r in rows for k in r["stages_s"]}
    return [s for s in STAGE_ORDER if s in seen] + sorted(seen - set(STAGE_ORDER))


def tables(result: dict) -> list:
    """The rich tables of a result: one row per stage, one column per (shape, method) run, each cell the stage's
    seconds and its peak resident memory; then the fitted growth exponents."""
    from rich.table import Table

    rows, stages = result["rows"], _stages(result["rows"])
    table = Table(title="grom bench --scale: seconds / peak resident GB per stage (`unlearn`: the method's stages "
                        "above it, inside it)")
    table.add_column("stage")
    for r in rows:
        table.add_column(f"{r['shape']} {r['method']}", justify="right")
    cells = {}
    for r in rows:
        column = []
        for stage in stages:
            got = r["stages_s"].get(stage)
            column.append("" if got is None else f"{got:.1f} / {r['stages_peak_mb'].get(stage, 0) / 1024:.1f}")
        cells[id(r)] = column
    for i, stage in enumerate(stages):
        table.add_row(stage, *[cells[id(r)][i] for r in rows])
    table.add_row("unlearn process", *[f"{r['unlearn_s']:.1f} / {r['unlearn_peak_mb'] / 1024:.1f}" if not r["error"]
                                       else (r["error"] or "")[:40] for r in rows])
    table.add_row("weights (GB)", *[f"{r['weights_mb'] / 1024:.2f}" for r in rows])
    growth = Table(title="growth with width: seconds ~ width^b, least squares over the shapes")
    growth.add_column("stage")
    methods = list(result["growth"])
    for method in methods:
        growth.add_column(method, justify="right")
    fitted = [s for s in stages if any(s in g for g in result["growth"].values())]
    for stage in fitted:
        growth.add_row(stage, *[f"{result['growth'][m][stage]:.2f}" if stage in result["growth"][m] else ""
                                for m in methods])
    tables_ = [table, growth]
    if result.get("projected"):
        projection = Table(title="projected to Llama-3-8B's shape on this machine, seconds (width^b times depth)")
        projection.add_column("stage")
        for method, got in result["projected"].items():
            projection.add_column(f"{method} (from {got['from']})", justify="right")
        for stage in [s for s in stages if any(s in p["stages_s"] for p in result["projected"].values())]:
            projection.add_row(stage, *[f"{p['stages_s'][stage]:.0f}" if stage in p["stages_s"] else ""
                                        for p in result["projected"].values()])
        tables_.append(projection)
    return tables_


def main(argv: Sequence[str]) -> None:
    """The child entry point of the revert step: `python -m flows.scale revert MODEL_DIR EDIT_DIR`."""
    if len(argv) != 3 or argv[0] != "revert":
        sys.stderr.write("usage: python -m flows.scale revert MODEL_DIR EDIT_DIR\n")
        raise SystemExit(2)
    sys.stdout.write(json.dumps(revert_check(argv[1], argv[2])) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
