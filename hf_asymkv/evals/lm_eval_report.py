"""Per-task scores of every scheme with 95% intervals, their differences to full precision, and the tables.

A task's score is the mean of its per-sample values (RULER: the fraction of expected answers found, in [0, 1]).
Its 95% interval is Wilson's score interval at the sample count: exact for 0/1 values, and wider than needed for
fractional ones (a value in [0, 1] with mean p has a variance of at most p(1 - p)). A scheme's difference to full
precision is paired (the same samples): its interval is the normal one of the per-sample differences, which is
[0, 0] when no sample changed. "Within" asks the issue's question: does the scheme's score fall inside full
precision's own 95% interval?
"""

from __future__ import annotations

import math

__all__ = ["compare_forms", "compare_schemes", "forms_markdown", "lm_eval_markdown", "paired_difference",
           "wilson_interval"]

Z95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson_interval(mean: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion ``mean`` over ``n`` samples.

    Raises:
        ValueError: ``n`` < 1 or ``mean`` outside [0, 1].
    """
    if n < 1 or not 0.0 <= mean <= 1.0:
        raise ValueError(f"Wilson interval needs n >= 1 and a mean in [0, 1], got n={n}, mean={mean}")
    denominator = 1 + z * z / n
    center = (mean + z * z / (2 * n)) / denominator
    half = z * math.sqrt(mean * (1 - mean) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, center - half), min(1.0, center + half)


def paired_difference(values: list[float], reference: list[float], z: float = Z95) -> dict:
    """Mean of ``values - reference`` (same samples, same order), its normal 95% interval, and how many samples
    scored lower and higher."""
    if len(values) != len(reference) or not values:
        raise ValueError(f"paired difference needs two equally long non-empty lists, got {len(values)} and "
                         f"{len(reference)}")
    diffs = [v - r for v, r in zip(values, reference)]
    n, mean = len(diffs), sum(diffs) / len(diffs)
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1)) if n > 1 else 0.0
    half = z * sd / math.sqrt(n)
    return {"diff": mean, "diff_interval": (mean - half, mean + half), "lower": sum(d < 0 for d in diffs),
            "higher": sum(d > 0 for d in diffs)}


def compare_schemes(scores: dict[str, list[float]], reference: str = "dynamic") -> dict[str, dict]:
    """``{scheme: {"n", "score", "interval", "diff", "diff_interval", "lower", "higher", "within"}}`` for one
    task's per-sample ``scores`` (``{scheme: values in [0, 1]}``, all on the same samples)."""
    ref = scores[reference]
    ref_interval = wilson_interval(sum(ref) / len(ref), len(ref))
    rows = {}
    for scheme, values in scores.items():
        mean = sum(values) / len(values)
        interval = wilson_interval(mean, len(values))
        rows[scheme] = {"n": len(values), "score": mean, "interval": interval, **paired_difference(values, ref),
                        "within": ref_interval[0] - 1e-12 <= mean <= ref_interval[1] + 1e-12}
    return rows


def _cell(row: dict, reference: bool) -> str:
    lo, hi = row["interval"]
    text = f"{row['score']:.2f} [{lo:.2f}, {hi:.2f}]"
    if reference:
        return text
    mark = "" if row["within"] else " **out**"
    return f"{text} {row['diff']:+.2f}{mark}"


def lm_eval_markdown(compared: dict[str, dict[str, dict]], labels: dict[str, str], title: str,
                     skipped: dict[str, str] | None = None, reference: str = "dynamic") -> str:
    """The summary table (schemes x tasks: score [95% interval] and difference to full precision, marked **out**
    where outside full precision's interval), the places where a scheme falls outside it and by how much, and one
    detailed table per task. ``compared``: ``{task: compare_schemes(...)}``; ``labels``: scheme display names."""
    tasks = list(compared)
    schemes = list(compared[tasks[0]])
    n = {t: compared[t][reference]["n"] for t in tasks}
    lines = [f"## {title}", "",
             "Score [95% interval] per task, then the difference to full precision (same samples); **out**: outside "
             "full precision's 95% interval.", "",
             "| scheme | " + " | ".join(f"{t} (n={n[t]})" for t in tasks) + " |",
             "|---|" + "---:|" * len(tasks)]
    for scheme in schemes:
        cells = [_cell(compared[t][scheme], scheme == reference) for t in tasks]
        lines.append(f"| {labels.get(scheme, scheme)} | " + " | ".join(cells) + " |")
    outside = [(scheme, t) for scheme in schemes for t in tasks if not compared[t][scheme]["within"]]
    lines += ["", "Outside full precision's 95% interval:" if outside else
              "Every scheme's score is inside full precision's 95% interval on every task."]
    for scheme, t in outside:
        row, (lo, hi) = compared[t][scheme], compared[t][reference]["interval"]
        gap = row["score"] - lo if row["score"] < lo else row["score"] - hi
        lines.append(f"- {labels.get(scheme, scheme)}, {t}: {row['score']:.2f}, {abs(gap):.2f} "
                     f"{'below' if gap < 0 else 'above'} the interval [{lo:.2f}, {hi:.2f}] "
                     f"({row['lower']} samples lower, {row['higher']} higher)")
    for scheme, reason in (skipped or {}).items():
        lines.append(f"- {labels.get(scheme, scheme)}: not run ({reason})")
    for t in tasks:
        lines += ["", f"### {t}", "", "| scheme | score | 95% interval | Δ vs full | Δ 95% interval (paired) | "
                  "samples lower / higher | inside full's interval |", "|---|---:|---:|---:|---:|---:|---|"]
        for scheme in schemes:
            row = compared[t][scheme]
            (lo, hi), (dlo, dhi) = row["interval"], row["diff_interval"]
            lines.append(f"| {labels.get(scheme, scheme)} | {row['score']:.3f} | [{lo:.3f}, {hi:.3f}] | "
                         f"{row['diff']:+.3f} | [{dlo:+.3f}, {dhi:+.3f}] | {row['lower']} / {row['higher']} | "
                         f"{'yes' if row['within'] else 'no'} |")
    return "\n".join(lines)


def compare_forms(scores: dict[str, list[float]], schemes: list[str], forms: list[str]) -> dict[str, dict[str, dict]]:
    """``{form: compare_schemes(...)}`` of one task: each form's schemes against full precision in the same form
    (``scores``: ``{variant: values}``, variants named by :func:`hf_asymkv.evals.forms.variant`)."""
    from .forms import variant

    return {form: compare_schemes({s: scores[variant(s, form)] for s in schemes}) for form in forms}


def forms_markdown(compared: dict[str, dict[str, dict[str, dict]]], scores: dict[str, dict[str, list[float]]],
                   labels: dict[str, str], title: str, skipped: dict[str, str] | None = None,
                   reference: str = "dynamic") -> str:
    """The forms side by side: per task one column per form (score [95% interval], difference to full precision in
    that form, **out** where outside its interval), then what changes from the first form to each other one (paired,
    per scheme and task), then each form's own table (:func:`lm_eval_markdown`).

    Args:
        compared: ``{task: compare_forms(...)}``.
        scores: ``{task: {variant: per-sample values}}``.
    """
    from .forms import variant

    tasks = list(compared)
    forms = list(compared[tasks[0]])
    schemes = list(compared[tasks[0]][forms[0]])
    n = {t: compared[t][forms[0]][reference]["n"] for t in tasks}
    lines = [f"## {title}", "", f"Forms side by side ({', '.join(forms)}): score [95% interval], then the difference "
             "to full precision in the same form (same samples); **out**: outside full precision's 95% interval.", "",
             "| scheme | " + " | ".join(f"{t} (n={n[t]}), {f}" for t in tasks for f in forms) + " |",
             "|---|" + "---:|" * (len(tasks) * len(forms))]
    for scheme in schemes:
        cells = [_cell(compared[t][f][scheme], scheme == reference) for t in tasks for f in forms]
        lines.append(f"| {labels.get(scheme, scheme)} | " + " | ".join(cells) + " |")
    first = forms[0]
    for form in forms[1:]:
        lines += ["", f"{form} minus {first}, same scheme and samples: difference [paired 95% interval], samples "
                  "lower / higher.", "", "| scheme | " + " | ".join(tasks) + " |", "|---|" + "---:|" * len(tasks)]
        for scheme in schemes:
            cells = []
            for t in tasks:
                d = paired_difference(scores[t][variant(scheme, form)], scores[t][variant(scheme, first)])
                (lo, hi) = d["diff_interval"]
                cells.append(f"{d['diff']:+.2f} [{lo:+.2f}, {hi:+.2f}] {d['lower']} / {d['higher']}")
            lines.append(f"| {labels.get(scheme, scheme)} | " + " | ".join(cells) + " |")
    for form in forms:
        table = lm_eval_markdown({t: compared[t][form] for t in tasks}, labels, f"{title}: form {form}", skipped,
                                 reference)
        lines += ["", "#" + table]  # one level below this page's title
    return "\n".join(lines)
