"""The output-anomaly guard: O(1)-state text detectors, AnomalyGuard (one choice's detectors), a worker's GuardSettings
(which run, act, only report) and GuardFilter, the per-request OutputFilter built from them (docs/anomaly_guard.md)."""
from __future__ import annotations

import dataclasses
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

from radixserve.sampling_params import SamplingParams
from radixserve.server.acceptance_guard import AcceptanceConfig, AcceptanceDetector
from radixserve.server.confidence_guard import ConfidenceConfig, ConfidenceDetector, judged
from radixserve.server.filters import Detection, Reporter
from radixserve.server.tracker import ChoiceUpdate
from radixserve.server_config import ServerConfig

KINDS = ("repetition", "garbled", "rare_chars")


@dataclass(frozen=True)
class GuardConfig:
    """Detector thresholds; counts in characters unless named otherwise."""

    max_period_chars: int = 80
    min_loop_chars: int = 256
    min_loop_repeats: int = 8
    min_bad_chars: int = 6
    min_bad_fraction: float = 0.03
    min_mixed_words: int = 4
    min_mixed_fraction: float = 0.15
    min_rare_chars: int = 3
    min_rare_fraction: float = 0.01


class Detector(Protocol):
    """One choice's online detector: fed each non-empty update in order; a Detection ends the request."""

    kind: str

    def feed(self, update: ChoiceUpdate) -> Detection | None: ...


class RepetitionDetector:
    """The last need(p) = max(min_loop_chars, min_loop_repeats * p) characters are p-periodic, p <= max_period_chars.
    Candidates p: earlier occurrences of the last KEY_CHARS characters; p-periodic iff buf equals itself shifted by p."""

    kind = "repetition"
    KEY_CHARS = 8

    def __init__(self, config: GuardConfig):
        self.max_period = config.max_period_chars
        self._need = [max(config.min_loop_chars, config.min_loop_repeats * p)
                      for p in range(1, self.max_period + 1)]
        assert min(n - p for p, n in enumerate(self._need, 1)) >= self.KEY_CHARS, \
            "min_loop_chars must exceed max_period_chars + KEY_CHARS"
        self._keep = max(self._need)
        self._tail = ""

    def feed(self, update: ChoiceUpdate) -> Detection | None:
        if not update.text:
            return None
        buf = self._tail = (self._tail + update.text)[-self._keep:]
        n, k = len(buf), self.KEY_CHARS
        if n < self._need[0]:
            return None
        key, lo, hi = buf[n - k:], max(n - k - self.max_period, 0), n - 1
        while (pos := buf.rfind(key, lo, hi)) >= 0:
            p = n - k - pos
            need = self._need[p - 1]
            if n >= need and buf[n - need + p:] == buf[n - need:n - p]:
                return Detection(self.kind, f"a {p}-character period repeated over the last "
                                            f"{need} characters (at least): {buf[n - p:]!r}")
            hi = pos + k - 1
        return None


@lru_cache(maxsize=65536)
def script_of(c: str) -> str:
    """A letter's script from its Unicode name ("LATIN", ...); Han, kana, Hangul, Bopomofo are all "CJK"."""
    name = unicodedata.name(c, "")
    head = name.split(" ", 1)[0]
    if head in ("CJK", "HIRAGANA", "KATAKANA", "HANGUL", "BOPOMOFO", "HALFWIDTH", "FULLWIDTH"):
        return "CJK"
    return head


# Scripts that mix normally inside one word: "Python编程", "Δx".
COMPATIBLE_SCRIPTS = frozenset({frozenset({"LATIN", "CJK"}), frozenset({"LATIN", "GREEK"})})
MOJIBAKE_LEADS = frozenset("ÃÂ")   # UTF-8 read as Latin-1: "Ã©" for "é", "Â " for NBSP


def is_bad_char(c: str, prev: str) -> bool:
    """U+FFFD, a lone surrogate, a C1 control, or the second half of a mojibake pair."""
    o = ord(c)
    return (c == "\ufffd" or 0xD800 <= o <= 0xDFFF or 0x80 <= o <= 0x9F
            or (prev in MOJIBAKE_LEADS and 0xA0 <= o <= 0xBF))


class GarbledDetector:
    """Bad characters (`is_bad_char`) or words mixing incompatible alphabets, each over a count and a share."""

    kind = "garbled"

    def __init__(self, config: GuardConfig):
        self.config = config
        self.num_chars = self.num_bad = 0
        self.num_words = self.num_mixed = 0
        self._prev = ""
        self._word_scripts: set[str] = set()

    def feed(self, update: ChoiceUpdate) -> Detection | None:
        for c in update.text:
            self.num_chars += 1
            if is_bad_char(c, self._prev):
                self.num_bad += 1
            if c.isalpha():
                self._word_scripts.add(script_of(c))
            elif self._word_scripts:
                self._end_word()
            self._prev = c
        cfg = self.config
        bad = self.num_bad
        if bad >= cfg.min_bad_chars and bad >= cfg.min_bad_fraction * self.num_chars:
            return Detection(self.kind, f"{self.num_bad} invalid or replacement characters in "
                                        f"{self.num_chars}")
        if (self.num_mixed >= cfg.min_mixed_words
                and self.num_mixed >= cfg.min_mixed_fraction * self.num_words):
            return Detection(self.kind, f"{self.num_mixed} of {self.num_words} words mix alphabets")
        return None

    def _end_word(self) -> None:
        scripts = self._word_scripts
        self.num_words += 1
        compatible = len(scripts) == 2 and frozenset(scripts) in COMPATIBLE_SCRIPTS
        if len(scripts) > 1 and not compatible:
            self.num_mixed += 1
        self._word_scripts = set()


# Control pictures and OCR, Braille, Yijing hexagrams, Yi radicals, musical symbols.
RARE_BLOCKS = ((0x2400, 0x245F), (0x2800, 0x28FF), (0x4DC0, 0x4DFF), (0xA490, 0xA4CF),
               (0x1D000, 0x1D1FF))
NORMAL_FORMAT_CHARS = frozenset("\u200c\u200d\u00ad\u2060")   # ZWNJ, ZWJ (emoji), soft hyphen, WJ


@lru_cache(maxsize=65536)
def is_rare_char(c: str) -> bool:
    """Private use, unassigned, control (but tab, newlines), format (but NORMAL_FORMAT_CHARS), or RARE_BLOCKS."""
    cat = unicodedata.category(c)
    if cat in ("Co", "Cn"):
        return True
    if cat == "Cc":
        return c not in "\t\n\r"
    if cat == "Cf":
        return c not in NORMAL_FORMAT_CHARS
    o = ord(c)
    return any(lo <= o <= hi for lo, hi in RARE_BLOCKS)


class RareCharDetector:
    """At least min_rare_chars `is_rare_char` characters and min_rare_fraction of the text."""

    kind = "rare_chars"

    def __init__(self, config: GuardConfig):
        self.config = config
        self.num_chars = self.num_rare = 0

    def feed(self, update: ChoiceUpdate) -> Detection | None:
        self.num_chars += len(update.text)
        self.num_rare += sum(1 for c in update.text if not c.isascii() or c < " " or c == "\x7f"
                             if is_rare_char(c))
        cfg = self.config
        rare = self.num_rare
        if rare >= cfg.min_rare_chars and rare >= cfg.min_rare_fraction * self.num_chars:
            return Detection(self.kind, f"{self.num_rare} rare characters in {self.num_chars}")
        return None


class AnomalyGuard:
    """All detectors of one choice; the first acting Detection sticks. `loops_expected` (greedy or grammar:
    a loop is the model's own deterministic answer, no retry fixes it) skips repetition. A detector whose
    kind is in `reported` only reports: its first Detection goes to `report`, then it is dropped."""

    def __init__(self, config: GuardConfig, extra_detectors: Sequence[Detector] = (),
                 loops_expected: bool = False, reported: frozenset[str] = frozenset(),
                 report: Callable[[Detection], None] | None = None):
        repetition: list[Detector] = [] if loops_expected else [RepetitionDetector(config)]
        self.detectors: list[Detector] = [*repetition, GarbledDetector(config),
                                          RareCharDetector(config), *extra_detectors]
        self.reported = reported
        self.report = report
        self.detection: Detection | None = None

    def feed(self, update: ChoiceUpdate) -> Detection | None:
        if self.detection is not None:
            return self.detection
        for detector in list(self.detectors):
            found = detector.feed(update)
            if found is None:
                continue
            if found.kind not in self.reported:
                self.detection = found
                break
            self.detectors.remove(detector)
            if self.report is not None:
                self.report(found)
        return self.detection


ACTIONS = ("report", "abort")
# --speculative-algorithm values whose draft is trained on the target: only then does collapsed acceptance act.
TRAINED_DRAFTS = frozenset({"EAGLE", "EAGLE3", "NEXTN"})


def acceptance_action(flag: str, speculative_algorithm: str | None) -> str:
    """--speculative-anomaly-action resolved: "auto" aborts only with a trained draft."""
    if flag != "auto":
        return flag
    trained = (speculative_algorithm or "").upper() in TRAINED_DRAFTS
    return "abort" if trained else "report"


class GuardFilter:
    """One request's anomaly guard as an OutputFilter: an AnomalyGuard per choice, made on first use;
    detections of `reported` kinds go to `report` with the choice index and do not end the request."""

    def __init__(self, settings: GuardSettings, loops_expected: bool,
                 confidence: ConfidenceConfig | None, reported: frozenset[str],
                 report: Reporter | None = None):
        self.settings = settings
        self.loops_expected = loops_expected
        self.confidence = confidence
        self.reported = reported
        self.report = report
        self._guards: dict[int, AnomalyGuard] = {}

    def feed(self, index: int, update: ChoiceUpdate) -> Detection | None:
        guard = self._guards.get(index)
        if guard is None:
            guard = self._guards[index] = self._new_guard(index)
        return guard.feed(update)

    def _new_guard(self, index: int) -> AnomalyGuard:
        extra: list[Detector] = []
        if self.settings.acceptance is not None:
            extra.append(AcceptanceDetector(self.settings.acceptance, self.loops_expected))
        if self.confidence is not None:
            extra.append(ConfidenceDetector(self.confidence))
        report = self.report
        return AnomalyGuard(self.settings.text, extra, loops_expected=self.loops_expected,
                            reported=self.reported,
                            report=None if report is None else lambda found: report(index, found))


@dataclass(frozen=True)
class GuardSettings:
    """A worker's anomaly guard: text thresholds and action, acceptance judge and action, confidence
    judge (None: off; it acts). Whatever the actions, a client-constrained request is only reported."""

    text: GuardConfig = GuardConfig()
    text_action: str = "report"
    acceptance: AcceptanceConfig | None = None
    acceptance_action: str = "report"
    confidence: ConfidenceConfig | None = None

    @classmethod
    def from_config(cls, c: ServerConfig, speculative_algorithm: str | None = None) -> GuardSettings | None:
        """The flags' guard (None: --disable-anomaly-guard); acceptance detector iff speculative_algorithm set."""
        if c.disable_anomaly_guard:
            return None
        acceptance = AcceptanceConfig(
            min_tokens=c.speculative_anomaly_min_tokens,
            min_verify_steps=c.speculative_anomaly_min_verify_steps,
            min_accept_length=c.speculative_anomaly_min_accept_length,
            max_accept_rate=c.speculative_anomaly_max_accept_rate) if speculative_algorithm else None
        confidence = ConfidenceConfig(
            window=c.confidence_window, min_mean_logprob=c.confidence_min_mean_logprob,
            min_drop=c.confidence_min_drop,
            max_temperature=c.confidence_max_temperature) if c.enable_confidence_detector else None
        return cls(GuardConfig(), c.anomaly_guard_action, acceptance,
                   acceptance_action(c.speculative_anomaly_action, speculative_algorithm), confidence)

    def reported_kinds(self, params: SamplingParams) -> frozenset[str]:
        """The detector kinds that only report for a request sampled with `params`."""
        every = frozenset((*KINDS, AcceptanceDetector.kind, ConfidenceDetector.kind))
        if params.client_constrained:
            return every
        reported = set(KINDS) if self.text_action == "report" else set()
        if self.acceptance_action == "report":
            reported.add(AcceptanceDetector.kind)
        return frozenset(reported)

    def filter_for(self, params: SamplingParams,
                   report: Reporter | None = None) -> tuple[GuardFilter, SamplingParams]:
        """One request's guard, and `params` with guard_confidence set when confidence is judged."""
        loops_expected = params.is_greedy or params.grammar is not None
        temperature = 0.0 if params.is_greedy else params.temperature
        confidence = self.confidence
        if confidence is not None and not judged(confidence, temperature, params.grammar is not None):
            confidence = None
        if confidence is not None:
            params = dataclasses.replace(params, guard_confidence=True)
        return GuardFilter(self, loops_expected, confidence, self.reported_kinds(params), report), params
