"""Model adapter: which modules of a Hugging Face causal LM an edit may touch, and how to read them.

The closed-form edit needs, per transformer layer, the MLP down-projection (its input is the key, its output is
added to the residual stream) and, once, the LM head, the final norm and the unembedding. Names differ per family;
this module knows the families below and lets a user name the modules by hand for anything else.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from grom_core.errors import UnsupportedArchitectureError

log = logging.getLogger(__name__)

try:  # Conv1D moved between transformers releases; GPT-2 stores its weights as [in, out].
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover - very old transformers
    from transformers.modeling_utils import Conv1D


@dataclass(frozen=True)
class FamilySpec:
    """Where one model family keeps the modules the edit needs (dotted paths from the top-level model)."""

    layers: str
    down_proj: str
    final_norm: str
    norm_kind: str  # "rms" or "layer": how the final norm divides, which the logit lens must mirror


_LLAMA_LIKE = FamilySpec(layers="model.layers", down_proj="mlp.down_proj", final_norm="model.norm", norm_kind="rms")

FAMILIES: dict[str, FamilySpec] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "gpt2": FamilySpec(layers="transformer.h", down_proj="mlp.c_proj", final_norm="transformer.ln_f",
                       norm_kind="layer"),
    "gpt_neox": FamilySpec(layers="gpt_neox.layers", down_proj="mlp.dense_4h_to_h",
                           final_norm="gpt_neox.final_layer_norm", norm_kind="layer"),
}

HAND_NAMING_HINT = (
    "name the modules by hand: ModelAdapter.from_names(model, layers='model.layers', down_proj='mlp.down_proj', "
    "final_norm='model.norm', norm_kind='rms')"
)


def get_module(model: nn.Module, path: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError as exc:
        raise UnsupportedArchitectureError(
            f"module '{path}' does not exist in {type(model).__name__}; check the name against "
            f"model.named_modules()"
        ) from exc


def output_head_name(model: nn.Module) -> str | None:
    """The dotted name of the model's output projection (`get_output_embeddings()`), or None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return next((n for n, m in model.named_modules() if head is not None and m is head), None)


def shares_input_embedding(model: nn.Module, module: nn.Module) -> bool:
    """True when `module`'s weight is the input embedding's tensor (a tied LM head): editing one edits both."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return embed is not None and getattr(module, "weight", None) is embed.weight


def is_conv1d(module: nn.Module) -> bool:
    """True for GPT-2's Conv1D, whose weight is [in, out] (the transpose of nn.Linear's [out, in])."""
    return isinstance(module, Conv1D)


def weight_out_in(module: nn.Module) -> torch.Tensor:
    """The module's weight as an [out, in] view, whatever its storage orientation. Branches on type, not shape."""
    if is_conv1d(module):
        return module.weight.T
    if isinstance(module, nn.Linear):
        return module.weight
    raise UnsupportedArchitectureError(
        f"cannot edit a {type(module).__name__}: only nn.Linear and GPT-2 Conv1D weights are editable"
    )


@dataclass
class ModelAdapter:
    """The editable modules of one loaded causal LM.

    Attributes:
        model: the model (not copied).
        block_names: per layer, the dotted name of the transformer block (its output is the residual stream).
        down_proj_names: per layer, the dotted name of the MLP down-projection; index = layer number.
        lm_head_name: dotted name of the output projection (hidden -> vocab).
        final_norm_name: dotted name of the final norm applied before the LM head.
        norm_kind: "rms" (RMSNorm: divides by the root mean square) or "layer" (LayerNorm: centres, then divides
            by the standard deviation).
    """

    model: nn.Module
    block_names: list[str]
    down_proj_names: list[str]
    lm_head_name: str
    final_norm_name: str
    norm_kind: str

    @classmethod
    def for_model(cls, model: nn.Module) -> ModelAdapter:
        """Adapter for a known family (read from `model.config.model_type`)."""
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        spec = FAMILIES.get(model_type)
        if spec is None:
            raise UnsupportedArchitectureError(
                f"unknown architecture '{model_type}' (known: {', '.join(sorted(FAMILIES))}); {HAND_NAMING_HINT}"
            )
        return cls.from_names(model, layers=spec.layers, down_proj=spec.down_proj, final_norm=spec.final_norm,
                              norm_kind=spec.norm_kind)

    @classmethod
    def from_names(cls, model: nn.Module, *, layers: str, down_proj: str, final_norm: str, norm_kind: str = "rms",
                   lm_head: str | None = None) -> ModelAdapter:
        """Adapter from hand-given names, for families this module does not know.

        Args:
            layers: dotted path of the ModuleList of transformer blocks.
            down_proj: path of the MLP down-projection inside one block.
            final_norm: path of the final norm.
            norm_kind: "rms" or "layer".
            lm_head: path of the output projection; default: the model's `get_output_embeddings()`.
        """
        if norm_kind not in ("rms", "layer"):
            raise UnsupportedArchitectureError(f"norm_kind must be 'rms' or 'layer', got '{norm_kind}'")
        blocks = get_module(model, layers)
        if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
            raise UnsupportedArchitectureError(
                f"'{layers}' is not a non-empty ModuleList of blocks; {HAND_NAMING_HINT}")
        block_names = [f"{layers}.{i}" for i in range(len(blocks))]
        names = [f"{block}.{down_proj}" for block in block_names]
        for name in names:
            weight_out_in(get_module(model, name))
        get_module(model, final_norm)
        if lm_head is None:
            lm_head = output_head_name(model)
            if lm_head is None:
                raise UnsupportedArchitectureError(
                    f"cannot find the LM head; pass lm_head=... ({HAND_NAMING_HINT})")
        weight_out_in(get_module(model, lm_head))
        return cls(model=model, block_names=block_names, down_proj_names=names, lm_head_name=lm_head,
                   final_norm_name=final_norm, norm_kind=norm_kind)

    @property
    def num_layers(self) -> int:
        return len(self.down_proj_names)

    def module(self, name: str) -> nn.Module:
        return get_module(self.model, name)

    @property
    def final_norm(self) -> nn.Module:
        return self.module(self.final_norm_name)

    @property
    def lm_head(self) -> nn.Module:
        return self.module(self.lm_head_name)

    def unembedding(self, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """(vocab, hidden) rows u_j of the LM head, multiplied by the final norm's scale (float64, detached), or
        only the rows of `tokens` (k,) as (k, hidden), which is all a target needs (a 49k-token head is 226 MB in
        float64).

        For LayerNorm the rows are also centred, because LayerNorm removes the mean of its input: a residual
        change d moves logit j by <u_j, d> / scale with u_j centred.
        """
        head = weight_out_in(self.lm_head).detach()
        head = (head if tokens is None else head[tokens.to(head.device)]).double().cpu()
        gain = getattr(self.final_norm, "weight", None)
        rows = head * gain.detach().double().cpu() if gain is not None else head.clone()
        if self.norm_kind == "layer":
            rows = rows - rows.mean(dim=1, keepdim=True)
        return rows

    def norm_scale(self, hidden: torch.Tensor) -> torch.Tensor:
        """The divisor the final norm applies to residual vectors `hidden` (..., hidden) -> (...), float64."""
        eps = float(getattr(self.final_norm, "variance_epsilon", getattr(self.final_norm, "eps", 1e-5)))
        h = hidden.double()
        if self.norm_kind == "layer":
            return torch.sqrt(h.var(dim=-1, unbiased=False) + eps)
        return torch.sqrt(h.pow(2).mean(dim=-1) + eps)

    # -- tied embeddings --------------------------------------------------------------------------------------
    def lm_head_is_tied(self) -> bool:
        """True when the LM head shares its weight tensor with the input embedding (GPT-2 and many small models)."""
        return shares_input_embedding(self.model, self.lm_head)

    def untie_lm_head(self) -> bool:
        """Give the LM head its own copy of the weight, so that editing it leaves the input embedding alone.

        Numerically a no-op (the weights fingerprint does not change); sets `config.tie_word_embeddings = False`
        so that a saved model keeps the two apart. Returns True when the head was tied.
        """
        if not self.lm_head_is_tied():
            return False
        head = self.lm_head
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)
        config = getattr(self.model, "config", None)
        if config is not None:
            config.tie_word_embeddings = False
            text_config = getattr(config, "get_text_config", lambda: None)()
            if text_config is not None and text_config is not config:
                text_config.tie_word_embeddings = False
        log.info("untied %s from the input embedding: editing the LM head will not change the input embedding",
                 self.lm_head_name)
        return True
