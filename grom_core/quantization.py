"""The quantization recovery attack: quantize-then-dequantize round trips of a model's linear weights.

Quantizers (each a function W [out, in] -> (deq(Q(W)), codes)):
- fp4, nf4: bitsandbytes 4-bit, absmax blocks of 64 (fp4 is what `load_in_4bit=True` alone gives);
- int8: row-wise absmax 8-bit (LLM.int8's vector-wise quantization, without the outlier split);
- rtn4: pure-torch round-to-nearest symmetric 4-bit with groups of 128 (no bitsandbytes needed);
- gguf_q4_1: llama.cpp's Q4_1 blocks of 32 with the LM head in Q8_0, as `llama-quantize ... Q4_1` writes a file
  (pure torch): the round trip a llama.cpp user runs, and a fixed point for a model read from such a file.
Two ways: every linear layer including the LM head, or the way transformers does it (LM head kept in full
precision, `fp4_head_kept`). A small edit can vanish in the rounding: the diagnostics say how many 4-bit codes the
edit changes and how much of its norm survives ||deq(Q(W+P)) - deq(Q(W))|| / ||P||.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from grom_core.adapter import is_conv1d, output_head_name, weight_out_in
from grom_core.stash import stashed

log = logging.getLogger(__name__)

Quantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _blocks(weight: torch.Tensor, block: int, fill: float = 0.0) -> torch.Tensor:
    """W [out, in] as float32 blocks [out, ceil(in / block), block] along the inputs, the last one padded with
    `fill`."""
    out_dim, in_dim = weight.shape
    padded = torch.nn.functional.pad(weight.float(), (0, (-in_dim) % block), value=fill)
    return padded.reshape(out_dim, -1, block)


def _unblocked(blocks: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Blocks back to `like`'s [out, in] shape and dtype, the padding dropped."""
    out_dim, in_dim = like.shape
    return blocks.reshape(out_dim, -1)[:, :in_dim].to(like.dtype)


def rtn4(weight: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest 4-bit, scale absmax / 7 per group of `group` inputs; (dequantized, codes)."""
    padded = _blocks(weight, group)
    scale = padded.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 7
    codes = torch.clamp(torch.round(padded / scale), -8, 7)
    return _unblocked(codes * scale, weight), _unblocked(codes, weight).to(torch.int8)


def gguf_q4_1(weight: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q4_1 (what `llama-quantize ... Q4_1` does to a row): blocks of 32 inputs, unsigned 4-bit codes
    q = floor((w - min) / d + 1/2) clamped to 0..15 with d = (max - min) / 15, and w' = q d + min with d and min
    stored as float16; (dequantized, codes). A model read from a Q4_1 GGUF file (SmolLM2 here) lies on this grid,
    so the round trip gives its weights back and erases whatever an edit moved by less than d / 2."""
    padded = _blocks(weight, block, fill=float("nan"))  # the padding must not set a block's min or max
    low = torch.nan_to_num(padded, nan=float("inf")).amin(dim=-1, keepdim=True)
    high = torch.nan_to_num(padded, nan=float("-inf")).amax(dim=-1, keepdim=True)
    d = (high - low) / 15
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    codes = torch.clamp(torch.floor((padded - low) * inverse + 0.5), 0, 15)
    deq = codes * d.half().float() + low.half().float()
    return _unblocked(deq, weight), _unblocked(torch.nan_to_num(codes, nan=0), weight).to(torch.int8)


def gguf_q8_0(weight: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_0: blocks of 32 inputs, codes round(w / d) with d = absmax / 127 stored as float16, w' = q d;
    (dequantized, codes). What a Q4_1 file keeps its token embedding (SmolLM2's tied output matrix) in."""
    padded = _blocks(weight, block)
    d = padded.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    scaled = padded * inverse
    codes = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)  # ggml's roundf: halves away from zero
    return _unblocked(codes * d.half().float(), weight), _unblocked(codes, weight).to(torch.int8)


def int8_rowwise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise absmax int8: scale absmax / 127 per output row; (dequantized, codes)."""
    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
    codes = torch.clamp(torch.round(w / scale), -127, 127)
    return (codes * scale).to(weight.dtype), codes.to(torch.int8)


def _bnb_4bit(kind: str) -> Quantizer:
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        import bitsandbytes.functional as bnbf

        packed, state = bnbf.quantize_4bit(weight.float().contiguous(), blocksize=64, quant_type=kind)
        deq = bnbf.dequantize_4bit(packed, state).reshape(weight.shape)
        flat = packed.flatten()
        codes = torch.stack([flat >> 4, flat & 0x0F], dim=1).flatten()  # two 4-bit codes per byte
        return deq.to(weight.dtype), codes
    return quantize


def bitsandbytes_available() -> bool:
    try:
        import bitsandbytes.functional as bnbf

        bnbf.quantize_4bit(torch.ones(64, 64), blocksize=64, quant_type="fp4")
        return True
    except Exception as exc:  # no wheel for this platform, or no CPU kernels
        log.warning("bitsandbytes is unavailable here (%s); only the pure-torch rtn4 quantizer runs", exc)
        return False


@dataclass(frozen=True)
class QuantSpec:
    """One attack: a quantizer and whether the LM head is quantized too."""

    name: str
    quantize: Quantizer
    include_lm_head: bool = True
    head_quantize: Quantizer | None = None  # the LM head's own format, where it differs (llama.cpp: 8 bits)

    def quantizer(self, head: bool = False) -> Quantizer:
        return self.head_quantize if head and self.head_quantize is not None else self.quantize


def quantizers(available: bool | None = None) -> dict[str, QuantSpec]:
    """The attacks that run on this machine: fp4, nf4, int8, rtn4, gguf_q4_1, fp4_head_kept (rtn4 and gguf_q4_1
    only without bitsandbytes)."""
    specs = {"rtn4": QuantSpec("rtn4", rtn4),
             "gguf_q4_1": QuantSpec("gguf_q4_1", gguf_q4_1, head_quantize=gguf_q8_0)}
    if available if available is not None else bitsandbytes_available():
        specs = {"fp4": QuantSpec("fp4", _bnb_4bit("fp4")), "nf4": QuantSpec("nf4", _bnb_4bit("nf4")),
                 "int8": QuantSpec("int8", int8_rowwise), **specs,
                 "fp4_head_kept": QuantSpec("fp4_head_kept", _bnb_4bit("fp4"), include_lm_head=False)}
    return specs


CHUNK_ROWS = 4096  # rows quantized at once: a multiple of 64, so bitsandbytes' flat blocks of 64 values never
# straddle two chunks and a chunked round trip equals the whole matrix's (every other quantizer's blocks are in a row)


def _linear_modules(model: nn.Module, include_lm_head: bool) -> dict[str, nn.Module]:
    head = output_head_name(model)
    return {name: m for name, m in model.named_modules()
            if (isinstance(m, nn.Linear) or is_conv1d(m)) and (include_lm_head or name != head)}


@contextmanager
@torch.no_grad()
def quantized(model: nn.Module, spec: QuantSpec) -> Iterator[int]:
    """Replace every targeted linear weight by its round trip for the `with` block; restore the exact bits after
    (from a stash on disk: the model is never held twice in memory). Yields the number of quantized matrices."""
    modules = _linear_modules(model, spec.include_lm_head)
    head = output_head_name(model)
    with stashed({name: m.weight for name, m in modules.items()}) as stash:
        try:
            for name, module in modules.items():
                w, quantize = weight_out_in(module), spec.quantizer(name == head)
                for start in range(0, w.shape[0], CHUNK_ROWS):  # the same codes as whole, a chunk's float32 at a time
                    part = w[start:start + CHUNK_ROWS]
                    part.copy_(quantize(part.detach())[0])
            yield len(modules)
        finally:
            stash.restore()




def edit_survival(weight: torch.Tensor, delta, spec: QuantSpec, head: bool = False) -> dict[str, float]:
    """How much of an edit P (a `ModuleDelta`) survives the round trip of W [out, in] (any dtype; `head`: W is the
    LM head): the fraction of codes it changes, and ||deq(Q(W+P)) - deq(Q(W))|| / ||P|| (1: survives whole, 0:
    rounded away). Read in chunks of rows, each quantized alone (every quantizer's blocks lie inside a chunk),
    and only where P touches a row: no full float64 copy of W, and an LM head edit of a few hundred rows reads
    those rows' chunks alone."""
    quantize = spec.quantizer(head)
    changed, moved, norm = 0, 0.0, 0.0
    for start in range(0, weight.shape[0], CHUNK_ROWS):
        stop = min(start + CHUNK_ROWS, weight.shape[0])
        if not delta.touches(start, stop):
            continue  # P is zero here: the same codes before and after
        w, p = weight[start:stop].double(), delta.rows(start, stop)
        before, codes_before = quantize(w.float())
        after, codes_after = quantize((w + p).float())
        changed += int((codes_before != codes_after).sum())
        moved += float((after.double() - before.double()).square().sum())
        norm += float(p.square().sum())
    kept = (moved ** 0.5) / (norm ** 0.5) if norm > 0 else 0.0
    return {"codes_changed": changed / max(1, weight.numel()), "norm_survival": kept}
