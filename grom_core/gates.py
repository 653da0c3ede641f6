"""Promotion gates: may an edited model replace the version in service?

An edit passes when the forget data is forgotten (absolute ROUGE-L ceiling, relative probability drop), the retain
data is kept (relative floors on its probability and ROUGE-L), and no quantization attack brings the forget answers
back. Gates read the flat metric dicts of `grom_core.benchmarks.owndata.evaluate_own` (or a benchmark's metrics).
A gate whose metric is absent (text-only data has no ROUGE-L) is not applied.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from grom_core.errors import DataError


@dataclass(frozen=True)
class Gates:
    """Thresholds. Ratios are after / before on the same data; recoveries are quantized - unquantized.

    Args:
        max_forget_rougeL_recall: the forget answers' ROUGE-L recall after the edit is at most this.
        max_forget_probability_ratio: the forget answers' probability falls at least to this fraction.
        min_retain_probability_ratio: the retain answers keep at least this fraction of their probability.
        min_retain_rougeL_ratio: the retain answers keep at least this fraction of their ROUGE-L recall.
        max_quantized_recovery: no quantization attack raises forget ROUGE-L recall by more than this.
    """

    max_forget_rougeL_recall: float = 0.5
    max_forget_probability_ratio: float = 0.5
    min_retain_probability_ratio: float = 0.8
    min_retain_rougeL_ratio: float = 0.9
    max_quantized_recovery: float = 0.1

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (isinstance(value, int | float) and value == value and value >= 0):
                raise DataError(f"gate {name} must be a non-negative number, got {value!r}")

    @classmethod
    def from_dict(cls, values: dict) -> Gates:
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise DataError(f"unknown gates {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**values)

    def check(self, before: dict, after: dict, quantized: dict | None = None) -> list[str]:
        """The reasons the edit fails, one line each; an empty list means it passes."""
        reasons = []
        rouge = after.get("forget_rougeL_recall")
        if _number(rouge) and rouge > self.max_forget_rougeL_recall:
            reasons.append(f"forget ROUGE-L recall {rouge:.3f} > {self.max_forget_rougeL_recall}")
        for key, bound, kind in (("forget_probability", self.max_forget_probability_ratio, "max"),
                                 ("retain_probability", self.min_retain_probability_ratio, "min"),
                                 ("retain_rougeL_recall", self.min_retain_rougeL_ratio, "min")):
            if not (_number(before.get(key)) and _number(after.get(key)) and before[key] > 0):
                continue
            ratio = after[key] / before[key]
            if (kind == "max" and ratio > bound) or (kind == "min" and ratio < bound):
                sign = ">" if kind == "max" else "<"
                reasons.append(f"{key.replace('_', ' ')} kept {ratio:.3f} of its value {sign} {bound}")
        for attack, metrics in (quantized or {}).items():
            recovery = metrics.get("recovery_forget_rougeL_recall") if isinstance(metrics, dict) else None
            if _number(recovery) and recovery > self.max_quantized_recovery:
                reasons.append(f"{attack} quantization recovers forget ROUGE-L by {recovery:+.3f} "
                               f"> {self.max_quantized_recovery}")
        return reasons


def _number(value) -> bool:
    return isinstance(value, int | float) and value == value
