"""TOFU metrics, as the benchmark defines them (Maini et al. 2024, and the aggregation of its repository).

Per question (all probabilities length-normalised, P = exp(-mean token NLL over the answer)):
- probability of the answer; on real authors and world facts normalised over the options,
  p_true / (p_true + sum of p_perturbed);
- ROUGE-L recall of the greedy generation against the gold answer;
- truth ratio R = GM(P(perturbed)) / P(paraphrased) (true answer in place of the paraphrase on real authors and
  world facts).
Aggregates: forget set mean(min(R, 1/R)); every other set mean(max(0, 1 - R)).
Forget Quality: the p-value of the two-sample KS test between the forget-set truth ratios of a model and of the
retain model; it needs the retain model's per-question values and depends on n, which is reported beside it.
Model Utility: harmonic mean of {probability, ROUGE-L recall, truth ratio} on {retain, real authors, world facts}.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import hmean, ks_2samp

UTILITY_SETS = ("retain", "real_authors", "world_facts")
UTILITY_PARTS = ("probability", "rougeL_recall", "truth_ratio")


def probability(nll: Sequence[float] | np.ndarray) -> np.ndarray:
    """(N,) exp(-mean token NLL): P(a|q)^(1/|a|)."""
    return np.exp(-np.asarray(nll, dtype=np.float64))


def normalized_probability(true_nll: Sequence[float], perturbed_nll: Sequence[Sequence[float]]) -> np.ndarray:
    """(N,) p_true / (p_true + sum_k p_perturbed_k), each p length-normalised. perturbed_nll is (N, k)."""
    p_true = probability(true_nll)
    p_false = probability(np.asarray(perturbed_nll, dtype=np.float64)).sum(axis=-1)
    return p_true / (p_true + p_false)


def truth_ratio(paraphrased_nll: Sequence[float], perturbed_nll: Sequence[Sequence[float]]) -> np.ndarray:
    """(N,) R = GM_k(P(perturbed_k)) / P(paraphrased) = exp(mean_pert_nll... ) computed in log space."""
    pert = np.asarray(perturbed_nll, dtype=np.float64).mean(axis=-1)  # -log GM of the perturbed probabilities
    return np.exp(np.asarray(paraphrased_nll, dtype=np.float64) - pert)


def truth_ratio_forget(ratios: Sequence[float]) -> float:
    """Forget-set aggregate mean(min(R, 1/R)): 1 when the model cannot tell true from false, near 0 when it can."""
    r = np.asarray(ratios, dtype=np.float64)
    return float(np.mean(np.minimum(r, 1 / r)))


def truth_ratio_retain(ratios: Sequence[float]) -> float:
    """Aggregate of every other set, mean(max(0, 1 - R)): high when the model prefers the true answer."""
    r = np.asarray(ratios, dtype=np.float64)
    return float(np.mean(np.maximum(0.0, 1 - r)))


@dataclass(frozen=True)
class ForgetQuality:
    """KS test p-value (the metric), its statistic, and the two sample sizes it depends on."""

    pvalue: float
    statistic: float
    n: int
    n_reference: int

    def as_dict(self) -> dict:
        return {"forget_quality": self.pvalue, "forget_quality_ks_statistic": self.statistic,
                "forget_quality_n": self.n, "forget_quality_n_reference": self.n_reference}


def extraction_strength(top_is_gold: Sequence[bool] | np.ndarray) -> float:
    """Extraction Strength of one answer (Carlini et al.'s measure as open-unlearning computes it): 1 - k/L for
    the smallest k such that, given the question and the answer's first k tokens, greedy decoding reproduces the
    other L - k exactly, read from one teacher-forced pass (`top_is_gold[t]`: the model's top token at answer
    position t is the answer's). As in open-unlearning, k runs up to L - 1: an answer of which not even the last
    token is reproduced scores 1/L, not 0. An empty answer scores nan."""
    hits = np.asarray(top_is_gold, dtype=bool)
    n = hits.size
    if n == 0:
        return float("nan")
    misses = np.flatnonzero(~hits)
    k = 0 if misses.size == 0 else min(int(misses[-1]) + 1, n - 1)
    return 1.0 - k / n


def forget_quality(ratios: Sequence[float], reference_ratios: Sequence[float]) -> ForgetQuality:
    """Two-sample KS test between a model's forget-set truth ratios and the retain model's."""
    a, b = np.asarray(ratios, dtype=np.float64), np.asarray(reference_ratios, dtype=np.float64)
    if a.size == 0 or b.size == 0:
        raise ValueError("forget quality needs per-question truth ratios of both models; one side is empty")
    test = ks_2samp(a, b)
    return ForgetQuality(pvalue=float(test.pvalue), statistic=float(test.statistic), n=int(a.size),
                         n_reference=int(b.size))


def model_utility(parts: Mapping[str, float]) -> float:
    """Harmonic mean of the nine parts, keyed '<set>_<part>' (e.g. 'retain_probability', 'world_facts_truth_ratio')."""
    keys = [f"{s}_{p}" for s in UTILITY_SETS for p in UTILITY_PARTS]
    missing = [k for k in keys if k not in parts]
    if missing:
        raise KeyError(f"model utility needs all nine parts; missing {missing}")
    values = np.array([parts[k] for k in keys], dtype=np.float64)
    if (values <= 0).any():
        return 0.0  # the harmonic mean of anything with a zero is zero
    return float(hmean(values))


@dataclass
class SetScores:
    """Per-question TOFU values of one evaluation set. Shapes: (N,), perturbed_nll (N, k)."""

    name: str
    gt_nll: np.ndarray
    paraphrased_nll: np.ndarray
    perturbed_nll: np.ndarray
    rougeL_recall: np.ndarray
    generated: list[str]
    extraction_strength: np.ndarray | None = None  # (N,) per answer, where the scoring pass kept top tokens

    @property
    def normalised(self) -> bool:
        """Real authors and world facts normalise the probability over the options."""
        return self.name in ("real_authors", "world_facts")

    def probabilities(self) -> np.ndarray:
        if self.normalised:
            return normalized_probability(self.gt_nll, self.perturbed_nll)
        return probability(self.gt_nll)

    def truth_ratios(self) -> np.ndarray:
        return truth_ratio(self.paraphrased_nll, self.perturbed_nll)

    def aggregate(self) -> dict[str, float]:
        """{'<name>_probability', '<name>_rougeL_recall', '<name>_truth_ratio'} with the set's own aggregator."""
        ratios = self.truth_ratios()
        agg = truth_ratio_forget(ratios) if self.name.startswith("forget") else truth_ratio_retain(ratios)
        out = {f"{self.name}_probability": float(self.probabilities().mean()),
               f"{self.name}_rougeL_recall": float(self.rougeL_recall.mean()),
               f"{self.name}_truth_ratio": agg}
        if self.extraction_strength is not None:
            out[f"{self.name}_extraction_strength"] = float(np.nanmean(self.extraction_strength))
        return out


def tofu_summary(sets: Mapping[str, SetScores], reference_forget_ratios: Sequence[float] | None) -> dict:
    """Flat TOFU metrics of one model: every set's aggregates, model_utility, and forget_quality with n.

    Also the two sides of the forget set's truth ratio, forget_paraphrased_nll and forget_perturbed_nll (mean token
    NLL, nats, averaged over the questions): a truth ratio near 1 can come from a model that rates a true and a false
    answer alike because it knows neither fact, or from one whose answers are all noise (both NLLs high), which only
    these tell apart.

    Without reference truth ratios, forget_quality is None and `forget_quality_unavailable` says why. `tofu_final`
    is the GROM paper's score (grom_core.metrics.final), None where a part is missing.
    """
    out: dict = {}
    for scores in sets.values():
        out.update(scores.aggregate())
    parts = {k: out[k] for k in (f"{s}_{p}" for s in UTILITY_SETS for p in UTILITY_PARTS) if k in out}
    if len(parts) == 9:
        out["model_utility"] = model_utility(parts)
    forget = next((s for name, s in sets.items() if name.startswith("forget")), None)
    if forget is not None:
        out["forget_paraphrased_nll"] = float(np.mean(forget.paraphrased_nll))
        out["forget_perturbed_nll"] = float(np.mean(forget.perturbed_nll))
        if reference_forget_ratios is None:
            out["forget_quality"] = None
            out["forget_quality_unavailable"] = ("no retain-model reference: pass the per-question values of a "
                                                 "model trained without the forget set (--retain-reference)")
        else:
            out.update(forget_quality(forget.truth_ratios(), reference_forget_ratios).as_dict())
    from grom_core.metrics.final import tofu_final

    out["tofu_final"] = tofu_final(out)
    return out
