"""An edit exported as a PEFT LoRA adapter: PEFT on the unchanged base model computes what the applied edit does."""

import json

import pytest
import torch
from conftest import FORGET, RETAIN

from grom_core import GromParams, run_grom
from grom_core.data import make_batches
from grom_core.edit import Edit, ModuleDelta
from grom_core.errors import DataError
from grom_core.grom import SpecificityDrops
from grom_core.lora import export_lora, lora_factors

peft = pytest.importorskip("peft", reason="PEFT is a dev dependency (pip install -e '.[dev]')")


def logits(model, batch):
    with torch.no_grad():
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits


def test_a_grom_edit_served_by_peft_equals_the_applied_edit(tiny_llama, tokenizer, tmp_path):
    run = run_grom(tiny_llama, tokenizer, FORGET, RETAIN,
                   GromParams(layers=(1, 2), specificity=SpecificityDrops(beta=40.0), influence=False))
    assert run.edit.deltas["lm_head"].row_index is not None  # the head's delta is row-sparse
    batch = make_batches(tokenizer, FORGET + RETAIN, 64)[0]
    with run.edit.applied(tiny_llama):
        expected = logits(tiny_llama, batch)
    before = logits(tiny_llama, batch)
    folder = export_lora(run.edit, tmp_path / "adapter", base_model="tiny-llama")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["rank_pattern"] == config["alpha_pattern"] and set(config["target_modules"]) == set(run.edit.modules)
    served = peft.PeftModel.from_pretrained(tiny_llama, str(folder)).eval()
    got = logits(served, batch)
    assert (expected - before).abs().max() > 1e-2  # the edit changes the logits...
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)  # ...and PEFT gives the same ones


def test_dense_and_row_sparse_deltas_factor_exactly():
    gen = torch.Generator().manual_seed(0)
    low_rank = torch.randn(6, 2, generator=gen, dtype=torch.float64) @ torch.randn(2, 5, generator=gen,
                                                                                   dtype=torch.float64)
    b, a = lora_factors(ModuleDelta("dense", (6, 5), dense=low_rank))
    assert a.shape[0] == 2 and torch.allclose(b @ a, low_rank, atol=1e-12)  # the exact rank, not min(m, n)
    sparse = ModuleDelta.from_factors("head", torch.ones(2, 1, dtype=torch.float64),
                                      torch.ones(1, 5, dtype=torch.float64), row_index=torch.tensor([1, 4]),
                                      out_features=9)
    b, a = lora_factors(sparse)
    assert torch.equal(b @ a, sparse.full())
    with pytest.raises(DataError, match="nothing to export"):
        export_lora(Edit({}, "f"), "unused")


def test_grom_model_export_lora_from_the_command_line(tiny_llama, tokenizer, tmp_path):
    import subprocess
    import sys

    edit = run_grom(tiny_llama, tokenizer, FORGET, RETAIN,
                    GromParams(layers=(1,), specificity=SpecificityDrops(beta=40.0), influence=False)).edit
    edit.save(tmp_path / "ws" / "edits" / edit.edit_id)

    def grom(*args):
        return subprocess.run([sys.executable, "-m", "flows.cli", "model", "export-lora", *args, "--home",
                               str(tmp_path / "ws")], capture_output=True, text=True, timeout=600)

    done = grom(edit.edit_id, "--out", str(tmp_path / "adapter"), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["edit_id"] == edit.edit_id
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    for bad in ("../../etc", "0123456789abcdef"):
        done = grom(bad, "--out", str(tmp_path / "other"))
        assert done.returncode == 2 and "Traceback" not in done.stderr and "edit" in done.stderr
    assert not (tmp_path / "other").exists()
