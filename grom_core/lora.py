"""An Edit as a PEFT LoRA adapter, so PEFT or vLLM users can serve it on the unchanged base model.

Every GROM delta is a low-rank additive update of a linear layer, which is what LoRA is: W' = W + (alpha / r) B A.
Each module gets B = left (out, k) and A = right (k, in) with r = alpha = k (scale 1), so B A is the edit's P; a
row-sparse delta (an LM head's) is written with its zero rows, a dense one through its exact SVD (rank = the number
of singular values above 1e-12 of the largest). Ranks differ per module: `rank_pattern` and `alpha_pattern` carry
them. The factors are written in float32 (PEFT adds B A x in the forward pass; merging it casts once, as apply does).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from grom_core.edit import Edit, ModuleDelta
from grom_core.errors import DataError

PREFIX = "base_model.model."  # how PeftModel names the wrapped model's modules


def lora_factors(delta: ModuleDelta, tolerance: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """(B (out, r), A (r, in)) float64 with B A = P."""
    if delta.factored:
        b = delta.left
        if delta.row_index is not None:
            b = torch.zeros(delta.shape[0], delta.left.shape[1], dtype=torch.float64)
            b[delta.row_index] = delta.left
        return b, delta.right
    u, s, vh = torch.linalg.svd(delta.full(), full_matrices=False)
    keep = max(1, int((s > tolerance * float(s.max().clamp_min(1e-300))).sum()))
    return u[:, :keep] * s[:keep], vh[:keep]


def export_lora(edit: Edit, out: str | Path, base_model: str = "") -> Path:
    """Write `adapter_config.json` and `adapter_model.safetensors` for `edit` into `out`; returns the folder.

    Args:
        edit: any Edit whose modules are linear layers ([out, in] deltas).
        out: the adapter folder (created).
        base_model: recorded as `base_model_name_or_path` (the folder or name of the model the edit was made on).
    """
    if not edit.deltas:
        raise DataError(f"edit {edit.edit_id} changes no module; there is nothing to export")
    tensors, ranks = {}, {}
    for name, delta in edit.deltas.items():
        b, a = lora_factors(delta)
        ranks[name] = int(a.shape[0])
        tensors[f"{PREFIX}{name}.lora_A.weight"] = a.float().contiguous()
        tensors[f"{PREFIX}{name}.lora_B.weight"] = b.float().contiguous()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rank = max(ranks.values())
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": rank, "rank_pattern": ranks, "alpha_pattern": ranks,
        "target_modules": sorted(edit.deltas), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "init_lora_weights": True, "modules_to_save": None, "use_rslora": False,
        "use_dora": False,
    }
    save_file(tensors, str(out / "adapter_model.safetensors"),
              metadata={"grom_edit_id": edit.edit_id, "base_fingerprint": edit.base_fingerprint})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out
