"""`grom bench` on a small minitofu: every row has the fixed keys, times, quantized metrics, a plot and MLflow runs."""

from pathlib import Path

import pytest
from conftest import ATTACK

from flows.bench import run_bench

pytestmark = pytest.mark.e2e  # the end-to-end tier: real flows, registry, catalog and CLI


def test_bench_rows_plot_and_mlflow(small_workspace):
    tmp_path = small_workspace / "ws"  # shared with the demo test: minitofu's models are trained once
    result = run_bench(str(tmp_path), "minitofu", None, ("grom", "npo:sago"), (ATTACK,),
                       {"epochs": 2}, authors=10)
    rows = result["rows"]
    assert [(r["label"], r["compose"], r["cached_stats"]) for r in rows] == [
        ("grom", None, False), ("grom", None, True), ("npo+sago", "sago", None)]
    assert result["columns"] == ["forget_rougeL_recall", "forget_quality", "model_utility"]
    for row in rows:
        assert {"method", "compose", "cached_stats", "seconds", "peak_rss_mb", "metrics", "quantized"} <= set(row)
        assert set(row["quantized"]) == {ATTACK}  # every attack is run by the demo test
        assert {"forget_rougeL_recall", "forget_quality", "model_utility"} <= set(row["metrics"])
        assert "recovery_forget_rougeL_recall" in row["quantized"][ATTACK]
    assert rows[0]["time_ratio_to_closed_form"] == 1.0 and rows[2]["steps"] > 0
    floor = result["floor"]
    assert result["floor_seconds"] == floor["forget_s"] + floor["retain_s"]
    assert floor["forget_tokens"] < floor["retain_tokens"]  # forget10 against retain90
    assert all(r["time_ratio_to_floor"] == pytest.approx(r["seconds"] / result["floor_seconds"]) for r in rows)
    after, before = rows[0]["metrics"], result["before"]
    assert after["forget_rougeL_recall"] < before["forget_rougeL_recall"]
    assert (tmp_path / "bench").is_dir() and result["plot"].endswith(".png") and result["config"] == {}
    assert Path(result["plot"]).name.startswith("pareto-minitofu-")  # the build's folder: one plot per variant
    assert len(result["mlflow"]["children"]) == 3
    from mlflow.tracking import MlflowClient

    parent = MlflowClient().get_run(result["mlflow"]["run_id"])
    assert parent.data.params["benchmark"] == "minitofu"


def test_ablation_rows_change_one_thing_each(small_workspace):
    from flows.ablation import ABLATIONS, run_ablation
    from grom_core.grom import GromParams

    tmp_path = small_workspace / "ws"
    result = run_ablation(str(tmp_path), "minitofu", None, ("benchmark parameters", "library defaults",
                                                            "no retain budget", "keys at answers",
                                                            "drops by position"), authors=10,
                          custom=[{"relative_ridge": 0.01}], attacks=("rtn4",))
    rows = {r["name"]: r for r in result["rows"]}
    # every row is read again after the attack: its recovery is the forget metric after the round trip minus before
    assert result["attacks"] == ["rtn4"] and result["forget_metric"] == "forget_rougeL_recall"
    for row in rows.values():
        attacked = row["quantized"]["rtn4"]
        assert attacked["recovery_forget_rougeL_recall"] == pytest.approx(
            attacked["forget_rougeL_recall"] - row["metrics"]["forget_rougeL_recall"])
    assert list(rows) == ["benchmark parameters", "library defaults", "keys at answers", "drops by position",
                          "no retain budget", '{"relative_ridge": 0.01}']  # the table's order, own last
    assert rows["library defaults"]["params"] == GromParams(influence=False).to_dict()
    own = rows['{"relative_ridge": 0.01}']
    assert own["params"] == GromParams(influence=False, relative_ridge=0.01).to_dict()
    assert own["metrics"] != rows["library defaults"]["metrics"]  # the change reached the solve
    for row in rows.values():
        assert set(result["columns"]) <= set(row["metrics"]) and row["seconds"] > 0
    # a band of layers is edited in every row (the body first, then the head: removal, not masking)
    assert rows["benchmark parameters"]["layers"] and rows["drops by position"]["layers"]
    # minitofu's rows name their authors and restate them in their answers: counterfactual drops at the answers,
    # which the row "keys at answers" only spells out
    assert rows["keys at answers"]["metrics"] == rows["benchmark parameters"]["metrics"]
    # rows whose edits give the model the same weights share the first one's evaluation, and say so
    assert rows["keys at answers"]["same_weights_as"] == rows["library defaults"]["same_weights_as"] == (
        "benchmark parameters")
    assert rows["benchmark parameters"]["same_weights_as"] is rows["drops by position"]["same_weights_as"] is None
    # the budget holds where it is set, and only ever scales an edit down: without it, at least as much is forgotten
    fit = rows["benchmark parameters"]["scaling"]["budget"]
    assert fit["damage"] <= rows["benchmark parameters"]["params"]["retain_budget"] and 0 < fit["scale"] <= 1
    assert rows["no retain budget"]["scaling"]["budget"] is None
    assert (rows["no retain budget"]["metrics"]["forget_probability"]
            <= rows["benchmark parameters"]["metrics"]["forget_probability"])
    assert len({r.name for r in ABLATIONS}) == len(ABLATIONS)


def test_ablation_refuses_an_unknown_row_before_any_work(tmp_path):
    from flows.ablation import run_ablation
    from grom_core.errors import DataError

    with pytest.raises(DataError, match="no ablation row named 'bogus'"):
        run_ablation(str(tmp_path / "ws"), "minitofu", None, ("bogus",), authors=10)
    with pytest.raises(DataError, match="relative_ridge must be float"):
        run_ablation(str(tmp_path / "ws"), "minitofu", None, None, authors=10, custom=[{"relative_ridge": "big"}])
    with pytest.raises(DataError, match="need gain > 0"):
        run_ablation(str(tmp_path / "ws"), "minitofu", None, None, authors=10, custom=[{"gain": -1}])
    with pytest.raises(DataError, match="need specificity.beta > 0"):
        run_ablation(str(tmp_path / "ws"), "minitofu", None, None, authors=10, custom=[{"specificity": {"beta": -1}}])
    with pytest.raises(DataError, match="no attack named 'q2'; attacks: fp4, nf4"):
        run_ablation(str(tmp_path / "ws"), "minitofu", None, None, authors=10, attacks=("gguf_q4_1", "q2"))
    assert not (tmp_path / "ws").exists()


def test_ablation_rows_apply_to_the_drop_kind_the_data_gets():
    from flows.ablation import ABLATIONS, applicable_rows
    from grom_core.data import Example
    from grom_core.grom import GromParams

    qa = [Example(question="Where was Aurelio Marlowe born?", answer="Aurelio Marlowe was born in Lisbon.")]
    named = [Example(question=qa[0].question, answer=qa[0].answer, subject="Aurelio Marlowe")]
    texts = [Example(text="In Sunmere, the mayor confirmed the news. Nobody saw it coming.")]
    suppress, corrupt = GromParams(), GromParams(target="corrupt")
    names = lambda rows, base=suppress: {r.name for r in applicable_rows(ABLATIONS, base, rows)}  # noqa: E731
    measured = {"gain x0.5", "gain x2", "specificity drops"}
    strangers = {"drops by position", "whole-name strangers", "answers after their own question only"}
    specific = {"beta x0.5", "beta x2", "word starts only",
                "defaults with forget target 0.05", "LM head alone"}
    keys = {"keys at answers", "keys at subjects", "keys at subjects and answers"}
    # texts without subjects: sentence drops, which gain and budget scale, and the QA rows' swapped questions; no
    # stranger or key rows
    assert measured | {"answers after an empty question", "last two layers"} <= names(texts)
    assert not (strangers | specific | keys | {"every layer"}) & names(texts)  # every layer is their default
    assert not {"answers after an empty question", "last two layers"} & (names(named) | names(qa))
    assert "every layer" in names(named) & names(qa)
    # subjects named: counterfactual drops and the key rows
    assert measured | strangers | keys <= names(named) and not specific & names(named)
    # QA pairs without subjects: the specificity drops' own rows only
    assert specific <= names(qa) and not (measured | strangers | keys) & names(qa)
    # multiple choice (corruption): neither drops nor keys matter
    assert not (measured | specific | keys | {"no retain budget"}) & names(texts, corrupt)
    assert "no retain budget" in names(texts) & names(named) & names(qa)  # every suppression keyed at answers
    assert {"library defaults", "parallel solve", "other target kind"} <= names(texts, corrupt)
    # a row's change is a pure function of the base parameters
    by_name = {r.name: r for r in ABLATIONS}
    assert by_name["gain x2"].change(suppress, 4) == {"gain": 2 * suppress.gain}
    assert by_name["ridge x100"].change(suppress, 4) == {"relative_ridge": 100 * suppress.relative_ridge}


def test_weights_digest_reads_the_factors_not_the_parameters():
    import torch

    from flows.ablation import weights_digest
    from grom_core.edit import Edit, ModuleDelta

    gen = torch.Generator().manual_seed(0)
    left, right = torch.randn(6, 2, generator=gen, dtype=torch.float64), torch.randn(2, 5, generator=gen,
                                                                                      dtype=torch.float64)
    delta = ModuleDelta.from_factors("lm_head", left, right)
    edit = Edit(deltas={"lm_head": delta}, base_fingerprint="f", params={"gain": 6.0})
    renamed = Edit(deltas={"lm_head": delta}, base_fingerprint="f", params={"gain": 6.0, "keys": "answer"})
    assert renamed.edit_id != edit.edit_id and weights_digest(renamed) == weights_digest(edit)
    scaled = Edit(deltas={"lm_head": delta.scaled(0.5)}, base_fingerprint="f", params={"gain": 6.0})
    assert weights_digest(scaled) != weights_digest(edit)
    assert weights_digest(Edit(deltas={"lm_head": delta}, base_fingerprint="g")) != weights_digest(edit)
