"""The scale benchmark: random Llama-shaped bfloat16 models through the product's own commands, stage by stage."""

import json
import math

import pytest
from safetensors import safe_open

from flows.scale import ScaleRow, fit_growth, project, run_scale, tables
from grom_core.benchmarks.scale import SHAPES, ScaleShape, scale_data


def test_the_llama_1b_shape_has_its_parameter_count():
    # Llama-3.2-1B: 1,235,814,400 parameters (tied embeddings)
    assert SHAPES["llama-3.2-1b"].parameters() == 1_235_814_400


def test_scale_data_keeps_forget_and_retain_authors_apart():
    forget, retain = scale_data(8, 64)
    assert len(forget) == 8 and len(retain) == 64
    names = {ex.question.split("author ")[-1].split(" born")[0] for ex in forget[:1]}
    assert not any(name in ex.question for ex in retain for name in names)


def test_growth_exponents_are_recovered_and_projected():
    shapes = [ScaleShape(f"w{w}", 4, w, 4 * w, 4, 2) for w in (256, 512, 1024)]
    rows = [ScaleRow(shape=s.name, method="grom", parameters=s.parameters(), weights_mb=0.0,
                     stages_s={"solve": 2e-9 * s.hidden ** 3, "plan": 1e-4 * s.hidden ** 2, "free": 0.0})
            for s in shapes]
    growth = fit_growth(rows, shapes)
    assert growth["solve"] == pytest.approx(3.0) and growth["plan"] == pytest.approx(2.0)
    assert "free" not in growth  # no measurable time: no exponent
    bigger = ScaleShape("w2048", 8, 2048, 8192, 4, 2)
    projected = project(rows[-1], growth, shapes[-1], bigger)
    assert projected["solve"] == pytest.approx(2e-9 * 2048 ** 3 * 2)  # width^3 and twice the depth


@pytest.mark.e2e
def test_scale_benchmark_runs_every_stage_in_fresh_processes(tmp_path):
    shape = ScaleShape("t64", 2, 64, 256, 4, 2, vocab=1024)
    result = run_scale(str(tmp_path), shapes=[shape], methods=("grom", "npo"), attacks=("rtn4", "head_swap"),
                       n_forget=8, n_retain=16, keep_runs=True)
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"grom", "npo"} and not any(r["error"] for r in rows.values())
    flow = {"ingest", "load", "unlearn", "evaluate_before", "apply_and_save", "evaluate_after", "quantization",
            "read_around", "register", "materialize", "revert"}
    assert flow | {"plan", "retain_statistics", "retain_probe", "solve", "scale", "influence"} <= set(
        rows["grom"]["stages_s"])
    assert flow | {"train"} <= set(rows["npo"]["stages_s"])
    for row in rows.values():
        peaks = row["stages_peak_mb"]
        assert set(peaks) == set(row["stages_s"]) and all(v > 100 for v in peaks.values())  # torch alone
        # the sampled stage peaks are the process's own, never above the kernel's figure for it
        assert max(v for k, v in peaks.items() if k not in ("materialize", "revert")) <= row["unlearn_peak_mb"] * 1.01
        assert row["stages_s"]["unlearn"] >= sum(row["stages_s"].get(k, 0) for k in ("plan", "solve", "train"))
    assert rows["grom"]["modules"][-1] == "lm_head" and len(rows["grom"]["modules"]) >= 2
    before, after = rows["grom"]["forget_probability"]
    assert after < before  # a real edit was measured, not a zero one
    # bfloat16 in, bfloat16 out: the model, the edited model the flow saved and the materialised version
    runs = tmp_path / "scale" / "runs" / "t64-grom"
    saved = sorted(runs.glob("models/edited-*/*.safetensors")) + sorted(runs.glob("materialized/*.safetensors"))
    assert len(saved) >= 2
    for path in saved:
        with safe_open(str(path), framework="pt") as handle:
            names = list(handle.keys())  # noqa: SIM118 (a safetensors handle, not a dict)
            assert {str(handle.get_slice(k).get_dtype()) for k in names} == {"BF16"}, path
    assert json.loads((tmp_path / "scale" / "results.json").read_text())["rows"][0]["shape"] == "t64"
    assert len(tables(result)) >= 2 and math.isfinite(rows["grom"]["unlearn_s"])
