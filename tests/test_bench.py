"""`grom bench` on a small minitofu: every row has the fixed keys, times, quantized metrics, a plot and MLflow runs."""

from flows.bench import run_bench, solve_scaling
from grom_core.gradient.methods import TrainerParams


def test_bench_rows_plot_and_mlflow(small_workspace):
    tmp_path = small_workspace / "ws"  # shared with the demo test: minitofu's models are trained once
    result = run_bench(str(tmp_path), "minitofu", None, ("grom", "npo:sago"), ("rtn4", "fp4"),
                       TrainerParams(epochs=2), authors=10)
    rows = result["rows"]
    assert [(r["label"], r["compose"], r["cached_stats"]) for r in rows] == [
        ("grom", None, False), ("grom", None, True), ("npo+sago", "sago", None)]
    assert result["columns"] == ["forget_rougeL_recall", "forget_quality", "model_utility"]
    for row in rows:
        assert {"method", "compose", "cached_stats", "seconds", "peak_rss_mb", "metrics", "quantized"} <= set(row)
        assert set(row["quantized"]) == {"rtn4", "fp4"} and row["seconds"] > 0 and row["peak_rss_mb"] > 0
        assert {"forget_rougeL_recall", "forget_quality", "model_utility"} <= set(row["metrics"])
        assert "recovery_forget_rougeL_recall" in row["quantized"]["fp4"]
    assert rows[0]["time_ratio_to_closed_form"] == 1.0 and rows[2]["steps"] > 0
    assert rows[1]["seconds"] < rows[0]["seconds"]  # the cached run skips the retain statistics
    after, before = rows[0]["metrics"], result["before"]
    assert after["forget_rougeL_recall"] < before["forget_rougeL_recall"]
    assert result["throughput"]["key_extraction_over_forward"] > 0
    assert (tmp_path / "bench").is_dir() and result["plot"].endswith(".png")
    assert len(result["mlflow"]["children"]) == 3
    from mlflow.tracking import MlflowClient

    parent = MlflowClient().get_run(result["mlflow"]["run_id"])
    assert parent.data.params["benchmark"] == "minitofu"


def test_solve_scaling_reports_every_size():
    rows = solve_scaling(sizes=(16, 32), s=8, m=4)
    assert [r["n"] for r in rows] == [16, 32] and all(r["seconds"] > 0 for r in rows)
