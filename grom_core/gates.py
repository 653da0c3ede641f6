"""Promotion gates: may an edited model replace the version in service?

An edit passes when the forget data is forgotten (absolute ROUGE-L ceiling, relative probability drop), the retain
data is kept (relative floors on its probability and ROUGE-L), and no quantization attack, nor any attack that reads
the model around the edit (grom_core.attacks), brings the forget answers back. Gates read the flat metric dicts of
`grom_core.benchmarks.owndata.evaluate_own` (or a benchmark's metrics).

The forget ROUGE-L ceiling reads the recall of what each answer adds to its question (`forget_added_rougeL_recall`)
where the metrics have it, as the user's own data's do: a model that never saw a fact still restates the question,
so "Gideon Thornbury was born in Osaka." keeps 5/6 of the recall of "Gideon Thornbury was born in Tallinn." (over
the ceiling) but 1/2 of what that answer adds to "Where was the author Gideon Thornbury born?". A benchmark's
metrics, which have only the whole answer's recall, are gated on that. The quantization gate stays on the whole
answer's recall: a recovery is a difference of one model's answers, where the restated question cancels.

Texts have no question to answer: their forget gate is VerbMem (`forget_verbatim_rougeL`, how much of each text
the model continues word for word from its first quarter) under `max_forget_verbatim_rougeL`, and its quantization
gate the recovery of that. Where the forget data holds texts only, the forget probability gate is not applied: a
model that never read a text still predicts most of its words (six minimuse articles, forgotten from a VerbMem of
1.0 to 0.31, kept 0.85 of their probability), so halving it would ask for a model worse than one that never read
them.

Gates fail closed: a gate whose metric is missing or NaN (a model that outputs NaN, an attack that did not run) is
a reason not to promote, so the request goes to review with it. The only gates not applied are those that do not
exist for the data (ROUGE-L of answers where there are only texts, VerbMem where there are only QA pairs: absent
before the edit too; the forget probability of texts only) and those set to None (`--gates
'{"max_quantized_recovery": null}'`), which switches a gate off on purpose.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from grom_core.errors import DataError
from grom_core.metrics.muse import FORGET_VERBATIM

FORGET_ADDED_ROUGE = "forget_added_rougeL_recall"  # see metrics.rouge.rouge_l_recall_added


@dataclass(frozen=True)
class Gates:
    """Thresholds. Ratios are after / before on the same data; recoveries are quantized - unquantized.

    Args:
        max_forget_rougeL_recall: the forget answers' ROUGE-L recall after the edit is at most this (the recall of
            what they add to their questions, where measured; see the module docstring).
        max_forget_verbatim_rougeL: the forget texts' VerbMem after the edit is at most this.
        max_forget_probability_ratio: the forget answers' probability falls at least to this fraction (not applied
            where the forget data holds texts only; see the module docstring).
        min_retain_probability_ratio: the retain answers keep at least this fraction of their probability.
        min_retain_rougeL_ratio: the retain answers keep at least this fraction of their ROUGE-L recall.
        max_quantized_recovery: no quantization attack raises the forget answers' ROUGE-L recall (texts only:
            their VerbMem) by more than this.
        max_attack_recovery: no attack that reads around the edit (grom_core.attacks: the base head on the edited
            model's hidden states, the logit lens, relearning) recovers more than this of its headline forget
            metric (the same metric as the quantization gate's; for relearning, the held-out forget facts'
            greedy accuracy, or for texts their probability): an edit that only hides the facts fails here.
    """

    max_forget_rougeL_recall: float | None = 0.5
    max_forget_verbatim_rougeL: float | None = 0.5
    max_forget_probability_ratio: float | None = 0.5
    min_retain_probability_ratio: float | None = 0.8
    min_retain_rougeL_ratio: float | None = 0.9
    max_quantized_recovery: float | None = 0.1
    max_attack_recovery: float | None = 0.1

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value is not None and not (isinstance(value, int | float) and not isinstance(value, bool)
                                          and math.isfinite(value) and value >= 0):
                raise DataError(f"gate {name} must be a finite non-negative number (or null to switch it off), "
                                f"got {value!r}")

    @classmethod
    def from_dict(cls, values: dict) -> Gates:
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise DataError(f"unknown gates {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**values)

    def check(self, before: dict, after: dict, quantized: dict | None = None, attacks: dict | None = None
              ) -> list[str]:
        """The reasons the edit fails, one line each; an empty list means it passes.

        Args:
            before, after: flat metrics of the model in service and of the edited model, on the same data.
            quantized: attack name -> metrics of the edited model after that attack, with
                `recovery_<forget metric>`; a key starting with "_" is a note (why an attack did not run).
            attacks: attack name -> metrics of the edited model after an attack that reads around it, with its
                headline `recovery` (grom_core.attacks.AttackKit.run).
        """
        reasons: list[str] = []
        qa = "forget_rougeL_recall" in before  # texts have no ROUGE-L, before the edit or after it
        rouge_key = FORGET_ADDED_ROUGE if FORGET_ADDED_ROUGE in before else "forget_rougeL_recall"
        if self.max_forget_rougeL_recall is not None and qa:
            rouge = after.get(rouge_key)
            what = "forget ROUGE-L recall" + (" of what the answers add" if rouge_key == FORGET_ADDED_ROUGE else "")
            if not _number(rouge):
                reasons.append(_unmeasured("forget ROUGE-L", rouge_key, rouge))
            elif rouge > self.max_forget_rougeL_recall:
                reasons.append(f"{what} {rouge:.3f} > {self.max_forget_rougeL_recall}")
        texts = FORGET_VERBATIM in before  # the forget data holds texts
        if self.max_forget_verbatim_rougeL is not None and texts:
            verbatim = after.get(FORGET_VERBATIM)
            if not _number(verbatim):
                reasons.append(_unmeasured("forget VerbMem", FORGET_VERBATIM, verbatim))
            elif verbatim > self.max_forget_verbatim_rougeL:
                reasons.append(f"forget texts' VerbMem (ROUGE-L F1 of their continuations) {verbatim:.3f} > "
                               f"{self.max_forget_verbatim_rougeL}")
        for key, bound, kind in (("forget_probability", self.max_forget_probability_ratio, "max"),
                                 ("retain_probability", self.min_retain_probability_ratio, "min"),
                                 ("retain_rougeL_recall", self.min_retain_rougeL_ratio, "min")):
            if bound is None or (key.endswith("rougeL_recall") and not qa) or (key == "forget_probability"
                                                                               and texts and not qa):
                continue
            was, now = before.get(key), after.get(key)
            if not (_number(was) and was > 0):
                reasons.append(_unmeasured(key.replace("_", " "), key, was, "before the edit"))
                continue
            if not _number(now):
                reasons.append(_unmeasured(key.replace("_", " "), key, now))
                continue
            ratio = now / was
            if (kind == "max" and ratio > bound) or (kind == "min" and ratio < bound):
                sign = ">" if kind == "max" else "<"
                reasons.append(f"{key.replace('_', ' ')} kept {ratio:.3f} of its value {sign} {bound}")
        if self.max_quantized_recovery is not None:
            # a difference of one model's answers, quantized or not: the restated question is in both and cancels,
            # and the whole answer's recall counts more words than the added ones alone
            metric = "forget_rougeL_recall" if qa else FORGET_VERBATIM if texts else "forget_probability"
            reasons += self._quantization_reasons(quantized or {}, metric)
        if self.max_attack_recovery is not None:
            reasons += self._attack_reasons(attacks or {})
        return reasons

    def _attack_reasons(self, attacks: dict) -> list[str]:
        if not attacks:
            return ["read-around gate not measured: no attack that reads around the edit ran; run them (the "
                    "service's evaluation 'attacks') or switch the gate off with max_attack_recovery null"]
        ran = {k: v for k, v in attacks.items() if not (isinstance(v, dict) and v.get("skipped"))}
        if not ran:
            why = "; ".join(f"{k}: {v['skipped']}" for k, v in attacks.items())
            return [f"read-around gate not measured: every attack was skipped ({why}); run one that applies or "
                    "switch the gate off with max_attack_recovery null"]
        reasons = []
        for attack, metrics in ran.items():
            recovery = metrics.get("recovery") if isinstance(metrics, dict) else None
            if not _number(recovery):
                reasons.append(_unmeasured(f"{attack} recovery", "recovery", recovery))
            elif recovery > self.max_attack_recovery:
                reasons.append(f"{attack} reads the forgotten data back: recovery {recovery:+.3f} > "
                               f"{self.max_attack_recovery}")
        return reasons

    def _quantization_reasons(self, quantized: dict, metric: str) -> list[str]:
        attacks = {k: v for k, v in quantized.items() if not k.startswith("_")}
        if not attacks:
            note = "; ".join(str(v) for k, v in quantized.items() if k.startswith("_"))
            return [f"quantization gate not measured: no attack ran{f' ({note})' if note else ''}; run one (the "
                    f"service's evaluation 'quantizers') or switch the gate off with max_quantized_recovery null"]
        reasons = []
        for attack, metrics in attacks.items():
            recovery = metrics.get(f"recovery_{metric}") if isinstance(metrics, dict) else None
            if not _number(recovery):
                reasons.append(_unmeasured(f"{attack} quantization recovery", f"recovery_{metric}", recovery))
            elif recovery > self.max_quantized_recovery:
                reasons.append(f"{attack} quantization recovers {metric.replace('_', ' ')} by {recovery:+.3f} "
                               f"> {self.max_quantized_recovery}")
        return reasons


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value



def _unmeasured(gate: str, key: str, value, when: str = "after the edit") -> str:
    if value is None:
        what = "missing"
    elif isinstance(value, float) and value != value:
        what = "NaN"
    elif _number(value):
        what = f"{value!r} (nothing to compare with)"
    else:
        what = f"{value!r} (not a number)"
    return f"{gate} gate not measured: {key} is {what} {when}"
