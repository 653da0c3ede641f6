"""Targets D: the desired change of a module's output at each forget position, built from forward passes only.

Two kinds:
- token suppression (generation benchmarks, TOFU/MUSE): lower the logit of the gold next token y_t, in proportion
  to how characteristic y_t is of the forget set (the specificity weight a(y_t)), or by its counterfactual gap
  (grom_core.counterfactual), or a subject's whole bag of such tokens at each of its positions (`TokenDrops`);
- representation corruption (multiple choice, WMDP): move a layer's output to c * u, u a seeded random unit vector.

Units: `beta` is a logit drop (nats of log-odds). For the LM head the drop is exact before the retain constraint
pulls it back; for a down-projection the residual change is chosen so that the logit lens (final norm scale frozen
at its value for that position) predicts the same drop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch

SPECIFICITY_POWER = 2.0
"""a(j) is the forget share p(j) squared: a token used as often in retain as in forget answers (p = 1/2) weighs 1/4."""
SPECIFICITY_FLOOR = 0.5
"""Weights below a half are zeroed: a token is asked to drop only when p(j)^2 >= 1/2, i.e. when it is at least
1 + sqrt(2) (about 2.4) times as frequent in the forget answers as in the retain answers."""
RETAIN_PSEUDO_COUNT = 1.0
"""Add-one (Laplace) smoothing of the retain counts: a token never seen in the retain answers is not certain to be
specific."""


def specificity_weights(forget_tokens: Iterable[int], retain_tokens: Iterable[int], vocab_size: int, *,
                        power: float = SPECIFICITY_POWER, floor: float = SPECIFICITY_FLOOR,
                        pseudo_count: float = RETAIN_PSEUDO_COUNT) -> torch.Tensor:
    """a(j) = p(j)^power where p(j) >= 0 and p^power >= floor, else 0; (vocab,) float64 in [0, 1].

    p(j) = f_forget(j) / (f_forget(j) + f_retain(j)) on relative token frequencies, the retain counts smoothed by
    `pseudo_count` per vocabulary entry. Tokens never seen in the forget set get 0. The defaults are the module's
    constants (their rules above); power 1, floor 0 and pseudo_count 0 give the raw share.

    Args:
        forget_tokens, retain_tokens: supervised token ids of each set.
    """
    f_counts, r_counts = Counter(forget_tokens), Counter(retain_tokens)
    f = torch.zeros(vocab_size, dtype=torch.float64)
    r = torch.zeros(vocab_size, dtype=torch.float64)
    for tok, n in f_counts.items():
        f[tok] = n
    for tok, n in r_counts.items():
        r[tok] = n
    f = f / max(1.0, f.sum().item())
    r = (r + pseudo_count) / max(1.0, r.sum().item() + pseudo_count * vocab_size)
    a = torch.where(f > 0, f / (f + r).clamp_min(1e-300), torch.zeros_like(f))
    a = a.pow(power)
    return torch.where(a >= floor, a, torch.zeros_like(a))


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


@dataclass(frozen=True)
class TokenDrops:
    """Which tokens to lower at each forget position, and by how much (nats of log-odds).

    Shapes: rows (u,) the distinct token ids asked to drop anywhere, sorted; amounts (u, s) float64 >= 0, the drop
    asked of token rows[i] at forget position t (0: leave it). Built by `at_next_tokens` (each position lowers its
    own gold next token, one non-zero per column) or `over_groups` (every position of a subject lowers every token
    flagged at any of its positions).
    """

    rows: torch.Tensor
    amounts: torch.Tensor

    @classmethod
    def at_next_tokens(cls, next_tokens: torch.Tensor, drops: torch.Tensor) -> TokenDrops:
        """drops (s,) asked of the gold next tokens next_tokens (s,)."""
        rows, where = torch.unique(next_tokens.cpu(), sorted=True, return_inverse=True)
        amounts = torch.zeros(rows.numel(), next_tokens.numel(), dtype=torch.float64)
        amounts[where, torch.arange(next_tokens.numel())] = drops.double().cpu()
        return cls(rows, amounts)

    @classmethod
    def over_groups(cls, next_tokens: torch.Tensor, drops: torch.Tensor, groups: torch.Tensor) -> TokenDrops:
        """Each group's drops spread over all its positions: at every position of group g, every token that is
        the gold next token somewhere in g is asked to drop by the largest drop it has there.

        Args:
            next_tokens, drops: (s,) gold next tokens and the drops asked of them.
            groups: (s,) group id of each position (the example's subject).
        Why: the edit is a linear map of the keys. Asked for different tokens at each position of one subject, it
        can only use what those positions' keys share (the subject) for their average; asked for the same bag at
        all of them, the subject's direction in key space carries the whole bag, and that direction is also in
        the keys of contexts the solve never saw (a paraphrase of the answer), where the facts then drop too.
        """
        own = cls.at_next_tokens(next_tokens, drops)
        ids, where = torch.unique(groups.cpu(), return_inverse=True)
        index = where[None, :].expand(own.rows.numel(), -1)
        largest = torch.zeros(own.rows.numel(), ids.numel(), dtype=torch.float64)
        largest = largest.scatter_reduce(1, index, own.amounts, reduce="amax")  # (u, groups)
        amounts = largest[:, where]
        keep = amounts.amax(dim=1) > 0
        return cls(own.rows[keep], amounts[keep])

    def entries(self) -> torch.Tensor:
        """(u, s) bool: where a drop is asked."""
        return self.amounts > 0


def lm_head_suppression(drops: TokenDrops) -> tuple[torch.Tensor, torch.Tensor]:
    """The LM head's D (vocab, s), D[rows[i], t] = -amounts[i, t] and zero elsewhere, stored by its non-zero rows.

    Returns (rows (u,), d (u, s) float64) with D[rows] = d. Every norm the solve and the influence audit take of D
    is the same on d (the other rows are zero).
    """
    return drops.rows, -drops.amounts


def residual_suppression(drops: TokenDrops, unembedding: torch.Tensor, norm_scale: torch.Tensor) -> torch.Tensor:
    """D (hidden, s) for a down-projection: at each position, the smallest residual change whose logit-lens effect
    lowers each token asked there by its drop.

    Args:
        drops: what to lower where (u rows, s positions).
        unembedding: (u, hidden) u_j of drops.rows (the adapter's `unembedding()`: head rows times the final
            norm's gain).
        norm_scale: (s,) the final norm's divisor at each forget position (RMS, or std for LayerNorm).
    d_t = -pinv(U_B) (a_B scale_t), B the tokens asked at t: for one token, d_t = -a scale_t u / ||u||^2, so
    <u, d_t> / scale_t = -a.
    """
    u = unembedding.double().cpu()
    scale = norm_scale.double().cpu()
    asked = drops.entries()
    out = torch.zeros(u.shape[1], asked.shape[1], dtype=torch.float64)
    count = asked.sum(dim=0)
    one = count == 1  # the common case (each position its own token), in one step
    if one.any():
        row = asked[:, one].double().argmax(dim=0)
        coef = -drops.amounts[row, one.nonzero().flatten()] * scale[one] / u[row].pow(2).sum(dim=1).clamp_min(1e-12)
        out[:, one] = (u[row] * coef[:, None]).T
    many = (count > 1).nonzero().flatten()
    if many.numel():
        patterns, which = torch.unique(asked[:, many].T, dim=0, return_inverse=True)
        for k, pattern in enumerate(patterns):
            cols = many[which == k]
            ub = u[pattern]
            out[:, cols] = -torch.linalg.pinv(ub) @ (drops.amounts[pattern][:, cols] * scale[cols])
    return out


def protected_tokens(asked: torch.Tensor, candidates: torch.Tensor, unembedding, count: int) -> torch.Tensor:
    """The `count` tokens among `candidates` (retain answer tokens) not in `asked` whose unembeddings are most
    aligned (largest |cosine|, over the asked tokens) with those asked to drop: the tokens a residual suppression
    of the asked ones would drag along. `unembedding(ids)` -> (len(ids), hidden)."""
    candidates = candidates[~torch.isin(candidates, asked.to(candidates.device))]
    if count < 1 or candidates.numel() == 0 or asked.numel() == 0:
        return candidates[:0]
    u = torch.nn.functional.normalize(unembedding(asked).double().cpu(), dim=1)
    c = torch.nn.functional.normalize(unembedding(candidates).double().cpu(), dim=1)
    alignment = (c @ u.T).abs().amax(dim=1)
    return candidates[alignment.argsort(descending=True)[:count]]


def project_out(rows: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """`rows` (u, hidden) minus their projection on the span of `kept` (k, hidden), in float64. A residual change
    built from the projected rows (residual_suppression) lowers the asked tokens by the same logit-lens drops and
    leaves the logit of every kept token where it was (to first order, the final norm's scale held)."""
    rows = rows.double().cpu()
    if kept.numel() == 0:
        return rows
    q, r = torch.linalg.qr(kept.double().cpu().T)  # (hidden, k): an orthonormal basis of the kept rows' span
    independent = r.diagonal().abs() > 1e-10 * r.diagonal().abs().max()
    q = q[:, independent]
    return rows - (rows @ q) @ q.T


def margin_beta(tokens: torch.Tensor, margins: torch.Tensor, weights: torch.Tensor, per_margin: float
                ) -> tuple[float, float]:
    """(beta, mean margin): `per_margin` times the mean margin of the forget answers' specific tokens.

    A fixed number of nats means little across models: a tiny model that memorised its answers prefers each gold
    token over the next by about 9 nats, SmolLM2 the capitals it knows by about 3.6, and a drop sized for the first
    takes the second's neighbouring facts with it (docs/minirwku.md). Measured in the model's own margins, the same
    setting asks each of them for as much as its confidence in these answers.

    Args:
        tokens: (s,) gold next token at each forget answer position; margins: (s,) its logit minus the best other
            token's (scoring.gold_margins), nats.
        weights: (vocab,) specificity a(j); only positions with a(y_t) > 0 (those the drops act on) are averaged,
            each margin clamped at 0 (a token the model does not prefer carries no confidence to undo).
        per_margin: beta in units of that mean margin.
    Returns beta = per_margin * mean margin (0 where no position has a specific token: nothing to lower).
    """
    specific = weights[tokens.cpu()] > 0
    if not bool(specific.any()):
        return 0.0, 0.0
    mean = float(margins[specific].clamp_min(0).mean())
    return per_margin * mean, mean


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
