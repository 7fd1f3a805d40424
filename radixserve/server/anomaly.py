"""Online output-anomaly detectors over one choice's generated text: runaway repetition, garbled text, rare-character noise.

Each detector sees every text delta once and keeps O(1) state: garbled and rare_chars look
at each new character once; repetition looks at a bounded tail (a few hundred characters,
C-level string search and compare) per delta. Pure Python (`unicodedata`), no torch.

    AnomalyGuard(config)                one per choice
      .feed(update)                     -> Detection | None   (the first detection sticks)
        RepetitionDetector   "repetition"  the tail is one short period repeated many times
        GarbledDetector      "garbled"     U+FFFD, lone surrogates, C1 controls, mojibake,
                                           words mixing alphabets (Latin+Cyrillic, ...)
        RareCharDetector     "rare_chars"  private-use, unassigned, control and format
                                           characters, symbols from rarely used blocks

With speculative decoding a fourth detector judges the draft acceptance
(`AcceptanceDetector`, server/acceptance_guard.py), fed by `ChoiceUpdate.spec`; it is added by
`AnomalyGuard(config, extra_detectors=[...])` and its kind is "spec_acceptance".

Thresholds (GuardConfig defaults) were set against ordinary generations of the default
model and of the tiny random test model; docs/anomaly_guard.md has the measured rates.
"""
from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple, Protocol

from radixserve.server.tracker import ChoiceUpdate

KINDS = ("repetition", "garbled", "rare_chars")


@dataclass(frozen=True)
class GuardConfig:
    """Detector thresholds. Counts are in characters (str items) unless named otherwise."""

    max_period_chars: int = 80       # loops of up to ~20 tokens of English text
    min_loop_chars: int = 256        # a loop must cover at least this much of the tail ...
    min_loop_repeats: int = 8        # ... and repeat its period at least this often
    min_bad_chars: int = 6           # garbled: U+FFFD / surrogates / C1 / mojibake pairs ...
    min_bad_fraction: float = 0.03   # ... and at least this share of the text
    min_mixed_words: int = 4         # garbled: words mixing two alphabets ...
    min_mixed_fraction: float = 0.15  # ... and at least this share of the words
    min_rare_chars: int = 3          # rare_chars: at least this many ...
    min_rare_fraction: float = 0.01  # ... and at least this share of the text


class Detection(NamedTuple):
    """What fired: `kind` in KINDS (or an extra detector's kind) and a human-readable reason."""

    kind: str
    detail: str


class Detector(Protocol):
    """An online detector of one choice: `feed` each non-empty update in order (its text, token
    ids, speculative counts so far and confidences); a non-None return ends the request."""

    kind: str

    def feed(self, update: ChoiceUpdate) -> Detection | None: ...


class RepetitionDetector:
    """Runaway repetition: the output's last need(p) = max(min_loop_chars, min_loop_repeats * p)
    characters are periodic with a period p <= max_period_chars.

    After each delta, over the last max need(p) characters kept: every earlier occurrence of
    the last KEY_CHARS characters within max_period_chars gives a candidate period p (any
    real loop of period p is among them, since need(p) >= p + KEY_CHARS), and a candidate
    counts when buf[-need(p):-p] == buf[-need(p)+p:] (a string is p-periodic iff it equals
    itself shifted by p). Normal text has no candidate, so a delta costs one C-level rfind
    over ~max_period_chars characters plus the copy of the kept tail.
    """

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
            p = n - k - pos                  # nearest occurrence first: smallest period first
            need = self._need[p - 1]
            if n >= need and buf[n - need + p:] == buf[n - need:n - p]:
                return Detection(self.kind, f"a {p}-character period repeated over the last "
                                            f"{need} characters (at least): {buf[n - p:]!r}")
            hi = pos + k - 1
        return None


@lru_cache(maxsize=65536)
def script_of(c: str) -> str:
    """The script of a letter from its Unicode name ("LATIN", "CYRILLIC", ...); Han, kana,
    Hangul and Bopomofo are one group "CJK" (they mix with each other and with Latin in
    normal text)."""
    name = unicodedata.name(c, "")
    head = name.split(" ", 1)[0]
    if head in ("CJK", "HIRAGANA", "KATAKANA", "HANGUL", "BOPOMOFO", "HALFWIDTH", "FULLWIDTH"):
        return "CJK"
    return head


# Letter scripts whose mixing inside one word is normal: Latin with CJK ("Python编程",
# "Python을") and Latin with Greek (math and units: "Δx", "μm").
COMPATIBLE_SCRIPTS = frozenset({frozenset({"LATIN", "CJK"}), frozenset({"LATIN", "GREEK"})})
MOJIBAKE_LEADS = frozenset("ÃÂ")   # UTF-8 read as Latin-1: "Ã©" for "é", "Â " for NBSP


def is_bad_char(c: str, prev: str) -> bool:
    """U+FFFD, a lone surrogate, a C1 control, or the second half of a mojibake pair."""
    o = ord(c)
    return (c == "\ufffd" or 0xD800 <= o <= 0xDFFF or 0x80 <= o <= 0x9F
            or (prev in MOJIBAKE_LEADS and 0xA0 <= o <= 0xBF))


class GarbledDetector:
    """Garbled text: replacement characters and invalid sequences above min_bad_chars and
    min_bad_fraction of the text, or words mixing incompatible alphabets ("hеllo" with a
    Cyrillic е) above min_mixed_words and min_mixed_fraction of the words."""

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


# Blocks almost never seen in model output, whatever the language: control pictures and
# OCR, Braille, Yijing hexagrams, Yi radicals, Byzantine and Western musical symbols.
RARE_BLOCKS = ((0x2400, 0x245F), (0x2800, 0x28FF), (0x4DC0, 0x4DFF), (0xA490, 0xA4CF),
               (0x1D000, 0x1D1FF))
NORMAL_FORMAT_CHARS = frozenset("\u200c\u200d\u00ad\u2060")   # ZWNJ, ZWJ (emoji), soft hyphen, WJ


@lru_cache(maxsize=65536)
def is_rare_char(c: str) -> bool:
    """Private use, unassigned, control (but tab and newlines), format (but ZWJ and friends),
    or a character from RARE_BLOCKS. Emoji, CJK, box drawing, math and arrows are normal."""
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
    """Rare-character noise: at least min_rare_chars rare characters (`is_rare_char`) and at
    least min_rare_fraction of the text."""

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
    """All detectors of one choice. `feed` returns the first Detection (and the same one on
    every later call: a choice that went wrong stays wrong).

    `loops_expected`: the choice decodes greedily or under a grammar (JSON schema, tool-call
    tags), so repetition is not judged. A loop under greedy decoding is the model's own
    deterministic answer, the same on every healthy worker (small models fall into them:
    2.3 % of greedy SmolLM2-135M answers, docs/anomaly_guard.md); text a grammar forces (a
    long function name, enum value or `const`, repeated array items) is periodic by
    construction. Stopping either would turn the answer into an error that no retry can fix.
    Garbled text and rare characters are judged either way.
    """

    def __init__(self, config: GuardConfig, extra_detectors: Sequence[Detector] = (),
                 loops_expected: bool = False):
        repetition: list[Detector] = [] if loops_expected else [RepetitionDetector(config)]
        self.detectors: list[Detector] = [*repetition, GarbledDetector(config),
                                          RareCharDetector(config), *extra_detectors]
        self.detection: Detection | None = None

    def feed(self, update: ChoiceUpdate) -> Detection | None:
        if self.detection is None:
            for detector in self.detectors:
                self.detection = detector.feed(update)
                if self.detection is not None:
                    break
        return self.detection
