"""Targets D: the desired change of a module's output at each forget position, built from forward passes only.

Two kinds:
- token suppression (generation benchmarks, TOFU/MUSE): lower the logit of the gold next token y_t, in proportion
  to how characteristic y_t is of the forget set (the specificity weight a(y_t));
- representation corruption (multiple choice, WMDP): move a layer's output to c * u, u a seeded random unit vector.

Units: `beta` is a logit drop (nats of log-odds). For the LM head the drop is exact before the retain constraint
pulls it back; for a down-projection the residual change is chosen so that the logit lens (final norm scale frozen
at its value for that position) predicts the same drop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch


def specificity_weights(forget_tokens: Iterable[int], retain_tokens: Iterable[int], vocab_size: int, *,
                        sharpness: float = 1.0, threshold: float = 0.0, smoothing: float = 0.0) -> torch.Tensor:
    """a(j) = f_forget(j) / (f_forget(j) + f_retain(j)) on relative token frequencies; (vocab,) float64 in [0, 1].

    Args:
        forget_tokens, retain_tokens: supervised token ids of each set.
        sharpness: a <- a ** sharpness; > 1 concentrates the weight on tokens that are rarer on the retain side.
        threshold: weights below it are set to 0 (shared vocabulary is left alone entirely).
        smoothing: pseudo-count added to every retain token count, so a token seen once in the forget set and
            never in retain is not treated as certainly specific.
    Tokens never seen in the forget set get 0.
    """
    f_counts, r_counts = Counter(forget_tokens), Counter(retain_tokens)
    f = torch.zeros(vocab_size, dtype=torch.float64)
    r = torch.zeros(vocab_size, dtype=torch.float64)
    for tok, n in f_counts.items():
        f[tok] = n
    for tok, n in r_counts.items():
        r[tok] = n
    f = f / max(1.0, f.sum().item())
    r = (r + smoothing) / max(1.0, r.sum().item() + smoothing * vocab_size)
    a = torch.where(f > 0, f / (f + r).clamp_min(1e-300), torch.zeros_like(f))
    a = a.pow(sharpness)
    return torch.where(a >= threshold, a, torch.zeros_like(a))


WORD_START_MARKERS = ("\u0120", "\u2581", " ")  # byte-level BPE's space (G-dot), SentencePiece's, a literal space


def word_start_mask(tokenizer, vocab_size: int) -> torch.Tensor:
    """(vocab,) bool: token j begins a word (its piece carries the tokenizer's space marker).

    A piece inside a word ("yang" of " Pyongyang") spells the word the first piece chose; it is shared by
    unrelated words ("Pyongyang", "Bangkok"...), so suppressing it hurts them while the first piece alone already
    withholds the answer. For a tokenizer without space markers every token counts as a word start.
    """
    pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    starts = [bool(p) and p.startswith(WORD_START_MARKERS) for p in pieces]
    if not any(starts):
        return torch.ones(vocab_size, dtype=torch.bool)
    mask[:len(starts)] = torch.tensor(starts)
    return mask


def lm_head_suppression(next_tokens: torch.Tensor, drops: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The LM head's D (vocab, s), D[y_t, t] = -drop_t and zero elsewhere, stored by its non-zero rows only.

    Args:
        next_tokens: (s,) gold next tokens y_t.
        drops: (s,) desired logit drop at each position, e.g. beta * a(y_t) (see `suppression_drops`).
    Returns (rows, d): rows (u,) the distinct tokens, sorted; d (u, s) float64 with D[rows] = d. Every norm the
    solve and the influence audit take of D is the same on d (the other rows are zero).
    """
    rows, where = torch.unique(next_tokens.cpu(), sorted=True, return_inverse=True)
    s = next_tokens.numel()
    d = torch.zeros(rows.numel(), s, dtype=torch.float64)
    d[where, torch.arange(s)] = -drops.double().cpu()
    return rows, d


def residual_suppression(next_tokens: torch.Tensor, drops: torch.Tensor, unembedding: torch.Tensor,
                         norm_scale: torch.Tensor) -> torch.Tensor:
    """D (hidden, s) for a down-projection: a residual change along u_{y_t} whose logit-lens effect on y_t is a
    drop of drop_t.

    Args:
        next_tokens: (s,) gold next tokens.
        drops: (s,) desired logit drops.
        unembedding: (vocab, hidden) u_j (the adapter's `unembedding()`: head rows times the final norm's gain).
        norm_scale: (s,) the final norm's divisor at each forget position (RMS, or std for LayerNorm).
    The change is d_t = -drop_t scale_t u / ||u||^2, so <u, d_t> / scale_t = -drop_t.
    """
    u = unembedding[next_tokens.cpu()].double()  # (s, hidden)
    coef = -drops.double().cpu() * norm_scale.double().cpu() / u.pow(2).sum(dim=1).clamp_min(1e-12)
    return (u * coef[:, None]).T.contiguous()


def suppression_drops(next_tokens: torch.Tensor, weights: torch.Tensor, beta: float) -> torch.Tensor:
    """(s,) the logit drop beta * a(y_t) asked for at each forget position."""
    return beta * weights[next_tokens.cpu()]


def random_direction(dim: int, seed: int) -> torch.Tensor:
    """A seeded unit vector (dim,), float64, from uniform noise as RMU draws it."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(dim, generator=gen, dtype=torch.float64)
    return u / u.norm()


def representation_corruption(layer_outputs: torch.Tensor, coefficient: float, seed: int) -> torch.Tensor:
    """D (hidden, s) = c u - h_t: moves the edited layer's output at each forget position to c u.

    Args:
        layer_outputs: (s, hidden) residual stream after the edited layer at the forget positions.
        coefficient: c, in the units of the residual stream (RMU uses 6.5 on 7B models; scale it with the typical
            residual norm of your model, see `suggest_coefficient`).
        seed: seed of the random direction u.
    """
    h = layer_outputs.double().cpu()
    u = random_direction(h.shape[1], seed)
    return (coefficient * u[None, :] - h).T.contiguous()


def suggest_coefficient(layer_outputs: torch.Tensor, multiple: float = 2.0) -> float:
    """A corruption coefficient `multiple` times the mean residual norm: far enough from every real activation."""
    return multiple * float(layer_outputs.double().norm(dim=1).mean())
