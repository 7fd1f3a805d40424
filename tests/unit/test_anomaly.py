"""Output-anomaly detectors: each fires on its anomaly and stays quiet on normal text of many kinds."""
from __future__ import annotations

import random

import pytest

from radixserve.server.anomaly import (AnomalyGuard, GarbledDetector, GuardConfig, RareCharDetector,
                                       RepetitionDetector)
from radixserve.chaos.http_faults import Corrupter
from radixserve.server.filters import Detection
from radixserve.server.tracker import ChoiceUpdate


def text_update(text: str) -> ChoiceUpdate:
    return ChoiceUpdate(0, text)

CONFIG = GuardConfig()

PROSE = ("The mitochondria is the powerhouse of the cell. It produces most of the chemical "
         "energy needed to power the cell's biochemical reactions, stored in a molecule called "
         "adenosine triphosphate (ATP). Mitochondria have their own DNA, which is inherited "
         "from the mother. Scientists believe they were once free-living bacteria that were "
         "absorbed by larger cells about two billion years ago. ") * 3
CODE = "def total(items):\n" + "".join(
    f"    value_{i} = items[{i}] * {i + 1}  # weight {i}\n" for i in range(40)) + "    return 0\n"
LIST = "".join(f"{i}. Item number {i}: buy {i} apples\n" for i in range(1, 40))
TABLE = ("| name | age | city |\n|------|-----|------|\n"
         + "".join(f"| person{i} | {20 + i} | town{i} |\n" for i in range(30)))
CJK = ("人工智能是计算机科学的一个分支，它企图了解智能的实质，并生产出一种新的能以人类智能相似的方式做出反应的智能机器。"
       "使用Python编程很有趣。東京は日本の首都です。ひらがなとカタカナと漢字を使います。"
       "한국어 문장입니다. Python을 배우고 있어요. ") * 4
EMOJI = "Great job 👍🏽! Family: 👨‍👩‍👧‍👦, flags 🇫🇷🇯🇵, hearts ❤️💙💚, weather ☀️⛅🌧. " * 6
MULTILINGUAL = ("Привет, как дела? Ça va très bien, merci. Größe und Übermaß. Ελληνικά κείμενα. "
                "مرحبا بالعالم. שלום עולם. नमस्ते दुनिया. สวัสดีครับ. Δx = 2πr, 5 μm, α+β=γ. ") * 4
TREE = "project/\n├── src/\n│   ├── main.py\n│   └── util.py\n└── README.md\n→ ≤ ≥ ∑ ∫ √ ∞ ° © ®\t\n" * 8
SHORT_REPEATS = "No. " * 12 + "ha " * 20 + "=" * 80 + "\n" + "0, " * 60 + "-" * 120 + "\n"
NORMAL_TEXTS = {"prose": PROSE, "code": CODE, "list": LIST, "table": TABLE, "cjk": CJK,
                "emoji": EMOJI, "multilingual": MULTILINGUAL, "symbols": TREE,
                "short_repeats": SHORT_REPEATS, "empty": ""}


def feed_in_pieces(detector, text: str, size: int = 5) -> Detection | None:
    """Feed like a stream: one small delta at a time; the last answer wins."""
    found = None
    for i in range(0, len(text), size):
        found = detector.feed(text_update(text[i:i + size])) or found
    return found


@pytest.mark.parametrize("name", sorted(NORMAL_TEXTS))
@pytest.mark.parametrize("size", [1, 7, 10_000])
def test_normal_text_is_left_alone(name, size):
    guard = AnomalyGuard(CONFIG)
    assert feed_in_pieces(guard, NORMAL_TEXTS[name], size) is None, name


@pytest.mark.parametrize("loop", ["the cat ", "a", "\n", " I'm sorry,", "1 2 ",
                                  "The answer is 42 and nothing else matters here. "])
def test_repetition_fires_on_runaway_loops(loop):
    text = "Sure, here is my answer: " + loop * (1200 // len(loop) + 1)
    found = feed_in_pieces(RepetitionDetector(CONFIG), text, 4)
    assert found is not None and found.kind == "repetition"
    assert len(loop) % int(found.detail.split("-character")[0].split()[-1]) == 0


def test_repetition_needs_both_length_and_repeats():
    period_100 = "".join(chr(ord("a") + i % 26) for i in range(100))
    assert feed_in_pieces(RepetitionDetector(CONFIG), period_100 * 12) is None  # period > 80
    assert feed_in_pieces(RepetitionDetector(CONFIG), "the cat " * 30) is None  # 240 chars < 256
    assert feed_in_pieces(RepetitionDetector(CONFIG), "the cat " * 33) is not None
    period_60 = "".join(chr(ord("a") + i % 26) for i in range(60))
    assert feed_in_pieces(RepetitionDetector(CONFIG), period_60 * 7) is None   # 7 repeats < 8
    assert feed_in_pieces(RepetitionDetector(CONFIG), period_60 * 9) is not None


def test_a_loop_that_ended_is_not_a_detection():
    text = "ab" * 100 + "then the model moved on and wrote something else entirely."
    assert feed_in_pieces(RepetitionDetector(CONFIG), text, 1) is None


@pytest.mark.parametrize("text", [
    "Hello \ufffd\ufffd world \ufffd\ufffd\ufffd and \ufffd more",
    "CafÃ© Ã¼ber naÃ¯ve rÃ©sumÃ© seÃ±or piÃ±ata faÃ§ade",      # UTF-8 read as Latin-1
    "text\x85with\x96C1\x9ccontrols\x80\x81\x82 everywhere",
    "h\u0435llo w\u043erld, th\u0435 c\u0430t s\u0430t on th\u0435 m\u0430t today",  # Cyrillic е, о, а
])
def test_garbled_fires(text):
    found = feed_in_pieces(GarbledDetector(CONFIG), text, 3)
    assert found is not None and found.kind == "garbled"


def test_garbled_ignores_a_few_replacement_chars_in_long_text():
    text = PROSE + "\ufffd" + PROSE + "\ufffd\ufffd" + PROSE
    assert feed_in_pieces(GarbledDetector(CONFIG), text) is None


@pytest.mark.parametrize("text", [
    "ok\ue000 fine\ue001 good\uf8ff",               # private use
    "a\x01b\x02c\x1bd\x7f",                          # C0 controls
    "x\u0378y\u0380z\u0379",                         # unassigned
    "hello ⠁⠃⠉ world ␛␀",                            # Braille, control pictures
    "zero\u200bwidth\u200bspaces\u200bhere\u2062",   # format characters
])
def test_rare_chars_fire(text):
    found = feed_in_pieces(RareCharDetector(CONFIG), text, 2)
    assert found is not None and found.kind == "rare_chars"


def test_rare_chars_need_a_density():
    text = PROSE + "\ue000" + PROSE + "\x01" + PROSE + "\ue001" + PROSE
    assert feed_in_pieces(RareCharDetector(CONFIG), text) is None


def test_guard_keeps_its_first_detection():
    guard = AnomalyGuard(CONFIG)
    first = guard.feed(text_update("a\ue000b\ue001c\ue002"))
    assert first is not None and first.kind == "rare_chars"
    assert guard.feed(text_update(" perfectly normal text")) == first


@pytest.mark.parametrize("mode,kind", [("garble", "garbled"), ("repeat", "repetition"),
                                       ("noise", "rare_chars")])
def test_every_corruption_mode_is_caught_by_its_detector(mode, kind):
    """The corrupt fault's modes against the guard, on prose streamed ~4 characters a delta."""
    corrupter = Corrupter(mode, random.Random(0))
    guard = AnomalyGuard(CONFIG)
    found = None
    for i in range(0, 1000, 4):
        update = text_update(PROSE[i:i + 4])
        corrupter.feed(0, update)   # an output filter: rewrites the text the guard then sees
        found = guard.feed(update)
        if found:
            break
    assert found is not None and found.kind == kind


def test_greedy_choices_are_not_judged_for_repetition():
    """A greedy loop is the model's deterministic answer; garbling still counts."""
    loop = "The water flows,\n" * 40
    assert AnomalyGuard(CONFIG).feed(text_update(loop)).kind == "repetition"
    assert AnomalyGuard(CONFIG, loops_expected=True).feed(text_update(loop)) is None
    garbled = AnomalyGuard(CONFIG, loops_expected=True).feed(text_update("ok " + "\ufffd" * 6))
    assert garbled is not None and garbled.kind == "garbled"
