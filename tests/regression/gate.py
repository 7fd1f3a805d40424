"""The count regression gate: a run's exact counts against the committed baseline.json, and its refresh.

    python -m tests.regression.gate             # run, print metric / baseline / now / verdict,
                                                # exit 1 when any count got worse
    python -m tests.regression.gate --update    # run and rewrite baseline.json (commit the diff)

Run from the repository root. Integers must match exactly and floats within FLOAT_TOLERANCE;
a metric that moved the wrong way (METRICS in counts.py says which way is better), a request-set
property that moved at all, or a metric or scenario missing on either side fails the gate. A
metric that moved the right way passes and asks for a refresh, so the gain is kept.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
from dataclasses import dataclass

from radixserve.bench.report import table
from tests.regression.counts import METRICS, run_all

BASELINE_PATH = pathlib.Path(__file__).with_name("baseline.json")
REFRESH_COMMAND = "python -m tests.regression.gate --update"
FLOAT_TOLERANCE = 1e-6   # floats are ratios of integers rounded to 6 decimals
FAILING = frozenset({"REGRESSED", "CHANGED", "MISSING", "NOT IN BASELINE"})

Counts = dict[str, dict[str, int | float]]   # scenario -> metric -> value


@dataclass(frozen=True, slots=True)
class Verdict:
    """One metric of one scenario: `verdict` is ok, improved, or one of FAILING."""

    scenario: str
    metric: str
    direction: str
    base: int | float | None
    now: int | float | None
    verdict: str

    @property
    def failed(self) -> bool:
        return self.verdict in FAILING


def judge(direction: str, base: int | float | None, now: int | float | None) -> str:
    """Verdict for one value: `direction` is "higher", "lower" (is better) or "same"."""
    if base is None:
        return "NOT IN BASELINE"
    if now is None:
        return "MISSING"
    tolerance = FLOAT_TOLERANCE if isinstance(base, float) or isinstance(now, float) else 0
    change = now - base
    if abs(change) <= tolerance:
        return "ok"
    if direction == "same":
        return "CHANGED"
    better = change > 0 if direction == "higher" else change < 0
    return "improved" if better else "REGRESSED"


def compare(baseline: Counts, now: Counts) -> list[Verdict]:
    """Every (scenario, metric) found on either side, baseline order first."""
    out = []
    for scenario in {**baseline, **now}:
        base, new = baseline.get(scenario, {}), now.get(scenario, {})
        for metric in {**base, **new}:
            direction = METRICS.get(metric, "same")
            out.append(Verdict(scenario, metric, direction, base.get(metric), new.get(metric),
                               judge(direction, base.get(metric), new.get(metric))))
    return out


def report(verdicts: list[Verdict]) -> str:
    """The metric / baseline / now / verdict table (Markdown, reads well in a terminal)."""
    rows = [[v.scenario, v.metric, f"{v.direction} is better" if v.direction != "same" else "same",
             "-" if v.base is None else str(v.base), "-" if v.now is None else str(v.now), v.verdict]
            for v in verdicts]
    return table(("scenario", "metric", "direction", "baseline", "now", "verdict"), rows)


def conclusion(verdicts: list[Verdict]) -> str:
    """One closing line: what failed, or that an improvement waits for a refresh, or no change."""
    failed = [v for v in verdicts if v.failed]
    if failed:
        return (f"REGRESSION: {len(failed)} count(s) worse, changed or missing (rows marked "
                f"{'/'.join(sorted({v.verdict for v in failed}))}). Fix the cause; if the trade-off "
                f"is intended, refresh with `{REFRESH_COMMAND}` and say why in the commit.")
    if any(v.verdict == "improved" for v in verdicts):
        return f"improved: nothing got worse; refresh the baseline with `{REFRESH_COMMAND}`."
    return "no change against the baseline."


def load_baseline(path: pathlib.Path = BASELINE_PATH) -> Counts:
    """The scenarios of a baseline file. Raises FileNotFoundError / json.JSONDecodeError."""
    return json.loads(path.read_text())["scenarios"]


def write_baseline(counts: Counts, path: pathlib.Path = BASELINE_PATH) -> None:
    """Write counts as the new baseline (stable key order, so its git diff is the change)."""
    doc = {"written_by": REFRESH_COMMAND,
           "about": "exact counts of tests/regression (see gate.py); do not edit by hand",
           "scenarios": counts}
    path.write_text(json.dumps(doc, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    """CLI entry (see the module docstring). Returns the exit code: 0 pass, 1 regression."""
    parser = argparse.ArgumentParser(prog="python -m tests.regression.gate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--update", action="store_true", help="rewrite the baseline with this run")
    parser.add_argument("--baseline", type=pathlib.Path, default=BASELINE_PATH)
    args = parser.parse_args(argv)
    now = run_all()
    old = load_baseline(args.baseline) if args.baseline.exists() else {}
    verdicts = compare(old, now)
    print(report(verdicts))
    if args.update:
        write_baseline(now, args.baseline)
        print(f"baseline written to {args.baseline}")
        return 0
    print(conclusion(verdicts))
    return 1 if any(v.failed for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
