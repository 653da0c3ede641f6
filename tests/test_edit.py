import pytest
import torch
from conftest import FORGET, RETAIN

from grom_core.adapter import ModelAdapter, weight_out_in
from grom_core.capture import collect
from grom_core.data import make_batches
from grom_core.edit import Edit, ModuleDelta, Undo
from grom_core.errors import FingerprintMismatchError, MissingUndoError, ShapeMismatchError, TiedWeightsError
from grom_core.fingerprint import weights_fingerprint
from grom_core.solver import solve_factors
from grom_core.statistics import accumulate


def random_edit(model, names, scale=1e-2, rank=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    deltas = {}
    for name in names:
        m, n = weight_out_in(model.get_submodule(name)).shape
        left = scale * torch.randn(m, rank, generator=gen, dtype=torch.float64)
        deltas[name] = ModuleDelta.from_factors(name, left, torch.randn(rank, n, generator=gen, dtype=torch.float64))
    return Edit(deltas=deltas, base_fingerprint=weights_fingerprint(model), params={"kind": "random"})


def state_bits(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bit_identical(before, model):
    after = model.state_dict()
    for k, v in before.items():
        assert torch.equal(v.view(torch.uint8) if v.dtype.is_floating_point else v,
                           after[k].view(torch.uint8) if v.dtype.is_floating_point else after[k]), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_apply_then_revert_restores_every_bit(tiny_llama, dtype):
    model = tiny_llama.to(dtype)
    adapter = ModelAdapter.for_model(model)
    edit = random_edit(model, adapter.down_proj_names[:2] + [adapter.lm_head_name], scale=0.3)
    before = state_bits(model)
    undo = edit.apply(model)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert undo.post_fingerprint != edit.base_fingerprint
    edit.revert(model)
    assert_bit_identical(before, model)


def test_chunked_apply_of_a_row_sparse_delta_adds_it_and_reverts_every_bit(tiny_llama, monkeypatch):
    """apply and revert walk a delta in chunks of rows and skip the chunks it does not touch; with chunks of a few
    rows, a head delta on rows 3, 4 and 40 spans touched and untouched chunks."""
    import grom_core.edit as edit_module

    model = tiny_llama.to(torch.float32)
    name = ModelAdapter.for_model(model).lm_head_name
    out_features, in_features = weight_out_in(model.get_submodule(name)).shape
    monkeypatch.setattr(edit_module, "ROW_CHUNK_ELEMENTS", 2 * in_features)  # two rows a chunk
    gen = torch.Generator().manual_seed(1)
    rows = torch.tensor([3, 4, 40])
    delta = ModuleDelta.from_factors(name, 0.1 * torch.randn(3, 2, generator=gen, dtype=torch.float64),
                                     torch.randn(2, in_features, generator=gen, dtype=torch.float64),
                                     row_index=rows, out_features=out_features)
    edit = Edit(deltas={name: delta}, base_fingerprint=weights_fingerprint(model), params={"kind": "random"})
    w0 = weight_out_in(model.get_submodule(name)).detach().double().clone()
    before = state_bits(model)
    with edit.applied(model):
        change = weight_out_in(model.get_submodule(name)).detach().double() - w0
        assert torch.allclose(change, delta.full(), atol=1e-6)
        untouched = torch.ones(out_features, dtype=torch.bool)
        untouched[rows] = False
        assert not change[untouched].any()  # every other row kept its bits
    assert_bit_identical(before, model)


def test_apply_changes_weights_by_the_delta_conv1d(tiny_gpt2):
    adapter = ModelAdapter.for_model(tiny_gpt2)
    name = adapter.down_proj_names[1]
    edit = random_edit(tiny_gpt2, [name])
    w0 = weight_out_in(tiny_gpt2.get_submodule(name)).detach().double().clone()
    before = state_bits(tiny_gpt2)
    with edit.applied(tiny_gpt2):
        w1 = weight_out_in(tiny_gpt2.get_submodule(name)).detach().double()
        assert torch.allclose(w1 - w0, edit.deltas[name].full(), atol=1e-6)  # [out, in] even for Conv1D
    assert_bit_identical(before, tiny_gpt2)


def test_refuses_another_model_and_a_tied_head(tiny_llama, tiny_gpt2):
    edit = random_edit(tiny_llama, ["lm_head"])
    tiny_llama.model.norm.weight.data[0] += 1.0
    with pytest.raises(FingerprintMismatchError, match="computed for model"):
        edit.apply(tiny_llama)
    tied = random_edit(tiny_gpt2, ["lm_head"])
    with pytest.raises(TiedWeightsError, match="untie") as refused:
        tied.apply(tiny_gpt2)
    assert not isinstance(refused.value, FingerprintMismatchError)  # the weights are the right ones; the tie is not


def test_revert_refuses_after_later_changes_and_works_from_a_saved_undo(tiny_llama, tmp_path):
    edit = random_edit(tiny_llama, ["model.layers.0.mlp.down_proj"])
    before = state_bits(tiny_llama)
    undo = edit.apply(tiny_llama)
    undo.save(tmp_path / "undo.safetensors")
    second = random_edit(tiny_llama, ["lm_head"], seed=1)
    second.apply(tiny_llama)
    with pytest.raises(FingerprintMismatchError, match="revert later edits first"):
        edit.revert(tiny_llama)
    second.revert(tiny_llama)
    tiny_llama.__dict__.pop("_grom_undo")  # as in a new process: only the saved undo is left
    with pytest.raises(MissingUndoError, match="Undo.load") as refused:
        edit.revert(tiny_llama)
    assert not isinstance(refused.value, FingerprintMismatchError)
    edit.revert(tiny_llama, Undo.load(tmp_path / "undo.safetensors"))
    assert_bit_identical(before, tiny_llama)


def test_save_load_round_trip_and_storage_choice(tiny_llama, tmp_path):
    edit = random_edit(tiny_llama, ["lm_head", "model.layers.2.mlp.down_proj"])
    wide = ModuleDelta.from_factors("x", torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64))
    assert not wide.factored and edit.deltas["lm_head"].factored  # rank 3 of 400 x 32 is smaller factored
    assert edit.deltas["lm_head"].frobenius_norm() == pytest.approx(
        float(torch.linalg.matrix_norm(edit.deltas["lm_head"].full())), rel=1e-10)
    back = Edit.load(edit.save(tmp_path / "edit"))
    assert back.edit_id == edit.edit_id and back.base_fingerprint == edit.base_fingerprint
    assert back.params == edit.params
    for name in edit.deltas:
        assert torch.equal(back.deltas[name].full(), edit.deltas[name].full())
    (tmp_path / "edit" / "edit.json").write_text((tmp_path / "edit" / "edit.json").read_text().replace(
        edit.edit_id, "0" * 16))
    with pytest.raises(FingerprintMismatchError, match="do not match"):
        Edit.load(tmp_path / "edit")


def test_edited_outputs_move_on_forget_keys_more_than_on_retain_keys(trained):
    tiny_llama, tokenizer = trained
    name = "model.layers.2.mlp.down_proj"
    forget_keys = collect(tiny_llama, make_batches(tokenizer, FORGET), inputs=[name]).inputs[name].double().T
    retain_batches = make_batches(tokenizer, RETAIN)
    stats = accumulate(tiny_llama, retain_batches, [name])[name]
    targets = -torch.ones(weight_out_in(tiny_llama.get_submodule(name)).shape[0], forget_keys.shape[1],
                          dtype=torch.float64)
    retain_before = collect(tiny_llama, retain_batches, outputs=[name]).outputs[name]
    forget_before = collect(tiny_llama, make_batches(tokenizer, FORGET), outputs=[name]).outputs[name]

    def moves(w_retain):
        left, right, _ = solve_factors(forget_keys, targets, stats.gram, stats.count, w_retain=w_retain, ridge=1e-4)
        edit = Edit({name: ModuleDelta.from_factors(name, left, right)}, weights_fingerprint(tiny_llama))
        with edit.applied(tiny_llama):
            retain_after = collect(tiny_llama, retain_batches, outputs=[name]).outputs[name]
            forget_after = collect(tiny_llama, make_batches(tokenizer, FORGET), outputs=[name]).outputs[name]
        return (forget_after - forget_before).norm(dim=1).mean(), (retain_after - retain_before).norm(dim=1).mean()

    forget_move, retain_move = moves(10.0)
    assert forget_move > 2 * retain_move
    forget_strict, retain_strict = moves(1000.0)
    assert retain_strict < retain_move / 2  # the retain weight does what it says


def test_a_row_sparse_delta_is_the_full_one_with_zero_rows(tiny_llama, tmp_path):
    """An LM-head edit keeps only the rows of the tokens it touches; apply, revert, norms, persistence and row
    lookups agree with the same delta stored dense."""
    adapter = ModelAdapter.for_model(tiny_llama)
    name = adapter.lm_head_name
    m, n = weight_out_in(tiny_llama.get_submodule(name)).shape
    gen = torch.Generator().manual_seed(3)
    rows = torch.tensor([1, 5, 7, m - 1])
    left, right = torch.randn(4, 2, generator=gen, dtype=torch.float64), torch.randn(2, n, generator=gen,
                                                                                     dtype=torch.float64)
    sparse = ModuleDelta.from_factors(name, 0.1 * left, right, row_index=rows, out_features=m)
    full = torch.zeros(m, n, dtype=torch.float64)
    full[rows] = 0.1 * left @ right
    dense = ModuleDelta(name, (m, n), dense=full)
    assert sparse.shape == (m, n) and torch.equal(sparse.full(), full)
    # a few rows' product may round differently from the whole factor product's (another BLAS kernel): to 1e-12
    torch.testing.assert_close(sparse.rows(4, 8), full[4:8], rtol=0, atol=1e-12)
    torch.testing.assert_close(sparse.rows_at(torch.tensor([7, 0, 7, m - 1])), full[[7, 0, 7, m - 1]], rtol=0,
                               atol=1e-12)
    assert sparse.frobenius_norm() == pytest.approx(float(full.norm()))
    assert sparse.distance(dense) == pytest.approx(0.0, abs=1e-12)
    assert not sparse.touches(8, m - 1) and sparse.touches(0, 2)
    with pytest.raises(ShapeMismatchError, match="sorted distinct"):
        ModuleDelta.from_factors(name, left, right, row_index=torch.tensor([5, 1, 7, 9]), out_features=m)
    before = state_bits(tiny_llama)
    edit = Edit({name: sparse}, weights_fingerprint(tiny_llama))
    with edit.applied(tiny_llama):
        changed = weight_out_in(tiny_llama.get_submodule(name)).detach().double() - before[f"{name}.weight"].double()
        assert (changed[[0, 2, 3, 4, 6]] == 0).all() and (changed[rows] != 0).any()
    assert_bit_identical(before, tiny_llama)
    loaded = Edit.load(edit.save(tmp_path / "edit"))
    assert torch.equal(loaded.deltas[name].row_index, rows) and loaded.edit_id == edit.edit_id


def test_weights_fingerprint_is_its_definition_on_any_thread_count_and_sees_one_bit(tiny_llama):
    import copy
    import hashlib
    import json

    model = copy.deepcopy(tiny_llama)
    outer = hashlib.sha256()  # the definition, written out: name, dtype, shape, sha256 of the raw bytes
    for name, tensor in sorted(model.state_dict().items()):
        outer.update(name.encode() + str(tensor.dtype).encode() + json.dumps(list(tensor.shape)).encode())
        outer.update(hashlib.sha256(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).digest())
    assert weights_fingerprint(model, threads=1) == weights_fingerprint(model, threads=4) == outer.hexdigest()
    ModelAdapter.for_model(model).untie_lm_head()
    assert weights_fingerprint(model) == outer.hexdigest()  # untying (or not, if untied) changes no weight
    weight = model.model.layers[0].mlp.down_proj.weight
    with torch.no_grad():
        bits = weight.view(torch.int32)
        bits[3, 5] ^= 1  # the lowest bit of one entry
    assert weights_fingerprint(model) != outer.hexdigest()
