"""Weights set aside on disk give the exact bits back, and the stage timer reads each stage's peak memory."""

import os
import time

import torch

from grom_core.profiling import Timings
from grom_core.stash import stashed


def test_stash_restores_every_dtype_bit_for_bit_and_leaves_no_file():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=gen)
    tensors = {"bf16": base.to(torch.bfloat16), "f32": base.clone(), "f16": base.to(torch.float16),
               "i64": torch.arange(7), "nan": torch.tensor([float("nan"), -0.0, float("inf")])}
    tensors["tied"] = tensors["f32"]  # the same tensor under two names (a tied head): stashed once
    tensors["view"] = tensors["f32"][1:4]  # another view of its storage: stashed on its own, the same bits back
    before = {k: v.clone() for k, v in tensors.items()}
    with stashed(tensors) as stash:
        path = stash.path
        assert path.is_file() and path.stat().st_size == sum(
            v.numel() * v.element_size() for k, v in tensors.items() if k != "tied")
        for t in tensors.values():
            t.zero_() if t.dtype.is_floating_point else t.fill_(3)
        stash.restore()
    assert not path.exists() and not os.path.exists(path.parent)
    for name, tensor in tensors.items():  # bits, not values: NaN and -0.0 included
        assert torch.equal(tensor.view(torch.uint8) if tensor.dtype != torch.int64 else tensor,
                           before[name].view(torch.uint8) if tensor.dtype != torch.int64 else before[name]), name


def test_stash_restores_a_transposed_parameter_in_place():
    weight = torch.nn.Parameter(torch.randn(4, 3))
    original = weight.detach().clone()
    with stashed({"w": weight.T}) as stash, torch.no_grad():
        weight.mul_(2)
        stash.restore()
    assert torch.equal(weight.detach(), original)


def test_timings_record_each_stage_peak_memory():
    timings = Timings()
    with timings.stage("small"):
        pass
    with timings.stage("large"):
        block = torch.ones(64, 2**20, dtype=torch.float32)  # 256 MB, touched, held past a few samples
        time.sleep(0.3)
        del block
    assert timings.peak_mb["large"] >= timings.peak_mb["small"] + 200
    assert set(timings.seconds) == set(timings.peak_mb) == {"small", "large"}
