"""Incremental detokenizer and stop-string matcher against the default model's real tokenizer (C12, C13, C15, C16)."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.tokenizer.detokenizer import IncrementalDetokenizer, StopStringMatcher
from radixserve.tokenizer.tokenizer import Tokenizer

FFFD = "\ufffd"


@pytest.fixture(scope="module")
def smollm(default_tokenizer) -> Tokenizer:
    return default_tokenizer


def build_sentencepiece_tokenizer() -> Tokenizer:
    """A small Llama-style tokenizer built in memory: Unigram with byte fallback, Metaspace
    spaces, and a decoder that strips the first space (no download needed)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    words = ["▁", "▁▁", "▁▁▁▁", "▁Hello", "▁world", ".", ",", "▁It", "▁is", "▁a", "▁test", "▁The",
             "▁quick", "▁fox", "\n", "▁def", "(", ")", ":", "▁return", "▁4", "中", "文"]
    words += list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    pieces += [(f"<0x{b:02X}>", -20.0) for b in range(256)]
    pieces += [(w, -1.0 - 0.01 * i) for i, w in enumerate(words)]
    raw = RawTokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return Tokenizer(hf)


@pytest.fixture(scope="module")
def sp_tok() -> Tokenizer:
    return build_sentencepiece_tokenizer()


@pytest.fixture(params=["smollm2", "sentencepiece"])
def tok(request) -> Tokenizer:
    """Both tokenizer families: byte-level BPE (the default model) and SentencePiece-style."""
    return request.getfixturevalue("smollm" if request.param == "smollm2" else "sp_tok")


def stream(tok, ids, sizes=None, skip_special_tokens=True) -> list[str]:
    """Feed ids in chunks of the given sizes (1 by default), then finish; return every delta."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens)
    deltas, i, sizes = [], 0, iter(sizes or [])
    while i < len(ids):
        n = next(sizes, 1)
        deltas.append(detok.add(ids[i:i + n]))
        i += n
    deltas.append(detok.finish())
    return deltas


MULTILINGUAL = {
    "chinese": "大型语言模型正在改变我们与计算机交流的方式。今天天气很好，我们去公园散步吧！",
    "japanese": "こんにちは、世界。日本語のテキストはひらがな、カタカナ、漢字を混ぜて書きます。",
    "thai": "สวัสดีครับ ภาษาไทยไม่มีการเว้นวรรคระหว่างคำ ทำให้การตัดคำเป็นเรื่องยาก",
    "emoji_zwj": "Family: 👨‍👩‍👧‍👦 and 👩‍❤️‍💋‍👨 and 🏳️‍🌈 done",
    "flags": "Flags 🇯🇵🇺🇸🇩🇪🇧🇷 in a row, then 🏴󠁧󠁢󠁳󠁣󠁴󠁿.",
    "skin_tones": "Thumbs 👍🏻👍🏼👍🏽👍🏾👍🏿 and waves 👋🏽 ok",
    "mixed": "Résumé naïve café — 中文 日本語 ไทย 한국어 Ελληνικά русский ✓ 😀🎉",
}


@pytest.mark.parametrize("name", sorted(MULTILINGUAL))
def test_multibyte_text_never_leaks_replacement_chars(tok, name):
    """C12: joined deltas == decode(all ids) and no delta holds U+FFFD, at any chunking."""
    ids = tok.encode(MULTILINGUAL[name])
    expected = tok.decode(ids)
    assert expected == MULTILINGUAL[name]
    assert any(FFFD in tok.decode([i]) for i in ids), "test text should split characters across tokens"
    rng = random.Random(name)
    for sizes in ([1] * len(ids), [rng.randint(1, 5) for _ in ids], [8] * len(ids)):
        deltas = stream(tok, ids, sizes)
        assert "".join(deltas) == expected
        assert not any(FFFD in d for d in deltas)


def test_character_is_released_as_soon_as_complete(smollm):
    ids = smollm.encode("鯨")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(smollm)
    assert [detok.add([i]) for i in ids] == [""] * (len(ids) - 1) + ["鯨"]


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_spaces_between_sentences_and_indented_code(tok, chunk):
    """C13: leading spaces, newlines and indentation survive streaming at 1 and 8 tokens a chunk."""
    text = ("LLMs are useful. It is 2024, and 3.14159 is pi.  Two spaces!\n\n"
            "```python\ndef area(r):\n    if r < 0:\n        raise ValueError(r)\n"
            "    return 3.14 * r ** 2\n```\n\t- item one\n\t- item two")
    ids = tok.encode(text)
    deltas = stream(tok, ids, [chunk] * len(ids))
    assert "".join(deltas) == tok.decode(ids) == text


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_in_the_middle(smollm, skip):
    ids = smollm.encode("Hello there") + [2, 1] + smollm.encode(" General Kenobi") + [0]
    deltas = stream(smollm, ids, skip_special_tokens=skip)
    assert "".join(deltas) == smollm.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in "".join(deltas)) is not skip


def test_real_replacement_char_is_emitted_once_text_moves_on(smollm):
    """A byte that never completes a character is final once later tokens decode; not held forever."""
    lone_lead = smollm.encode("鯨")[0]            # its first byte(s) only: decodes to U+FFFD
    ids = [lone_lead] + smollm.encode(" and more text")
    detok = IncrementalDetokenizer(smollm)
    assert detok.add(ids[:1]) == ""
    delta = detok.add(ids[1:2])
    assert delta.startswith(FFFD)
    rest = detok.add(ids[2:]) + detok.finish()
    assert delta + rest == smollm.decode(ids)


def test_incomplete_character_is_flushed_on_finish(smollm):
    lone_lead = smollm.encode("鯨")[0]
    deltas = stream(smollm, smollm.encode("Hi") + [lone_lead])
    assert deltas[-1] == FFFD
    assert "".join(deltas) == smollm.decode(smollm.encode("Hi") + [lone_lead])


class _CountingTokenizer:
    """Wraps a Tokenizer and records how many ids each decode() call sees."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self.special_token_ids = tok.special_token_ids
        self.byte_token_ids = tok.byte_token_ids
        self.calls: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.calls.append(len(ids))
        return self._tok.decode(ids, skip_special_tokens)


def test_linear_time_on_long_output(smollm):
    """20k tokens: each decode sees a small window, so total work is O(tokens), not O(tokens^2)."""
    paragraph = "".join(MULTILINGUAL.values()) + " The quick brown fox jumps over the lazy dog. "
    ids: list[int] = []
    while len(ids) < 20_000:
        ids += smollm.encode(paragraph)
    ids = ids[:20_000]
    counting = _CountingTokenizer(smollm)
    deltas = stream(counting, ids)
    assert max(counting.calls) <= 8, "a decode call re-read old output"
    # ~2-5 ids per token here (windows widen while a character is split); quadratic would be ~2e8.
    assert sum(counting.calls) <= 6 * len(ids)
    assert "".join(deltas) == smollm.decode(ids)


SAFE_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters=FFFD), max_size=60)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=SAFE_TEXT, seed=st.integers(0, 2**16))
def test_property_random_text_round_trips(tok, text, seed):
    ids = tok.encode(text)
    rng = random.Random(seed)
    deltas = stream(tok, ids, [rng.randint(1, 4) for _ in ids])
    assert "".join(deltas) == tok.decode(ids)
    if FFFD not in tok.decode(ids):  # the vocabulary lacks a few rare bytes (e.g. 0xF1): real U+FFFD
        assert not any(FFFD in d for d in deltas)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_property_random_token_ids_match_full_decode(tok, data, skip):
    """Arbitrary ids (invalid byte runs, specials) still join to exactly decode(all)."""
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=24))
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)))
    assert "".join(stream(tok, ids, sizes, skip)) == tok.decode(ids, skip_special_tokens=skip)


# ------------------------------------------------------------------------------ stop strings
def run_stops(tok, text, stop, include=False, chunk=1):
    """Detokenize `text` token by token through a StopStringMatcher; return (deltas, matched)."""
    ids = tok.encode(text)
    detok, matcher = IncrementalDetokenizer(tok), StopStringMatcher(stop, include)
    deltas = []
    for i in range(0, len(ids), chunk):
        check = matcher.feed(detok.add(ids[i:i + chunk]))
        deltas.append(check.text)
        if check.matched:
            return deltas, check.matched
    check = matcher.feed(detok.finish())
    deltas.append(check.text)
    if check.matched is None:
        deltas.append(matcher.flush())
    return deltas, check.matched


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_never_leaks(tok, include):
    """C15: no part of a multi-token stop string is ever streamed (unless asked to include it)."""
    text = "Here is the English alphabet: A B C D E F G H I J"
    deltas, matched = run_stops(tok, text, ["D E F G"], include)
    assert matched == "D E F G"
    expected = "Here is the English alphabet: A B C " + ("D E F G" if include else "")
    assert "".join(deltas) == expected
    sent = ""
    for d in deltas[:-1]:
        sent += d
        assert "D" not in sent


def test_partial_stop_prefix_is_released_when_it_cannot_match(tok):
    deltas, matched = run_stops(tok, "A B C D E X and D E F G", ["D E F G"])
    assert matched == "D E F G"
    assert "".join(deltas) == "A B C D E X and "
    assert "A B C D E X" in "".join(deltas[:-1])  # released before the real match arrived


@pytest.mark.parametrize("stop, expected, matched", [
    (["\n"], "?", "\n"),
    (["?\n"], "", "?\n"),
    (["Alice"], "?\n", "Alice"),
    (["nope"], "?\nAlice: It is red", None),
])
def test_bob_mars_tail(tok, stop, expected, matched):
    """C16: the match inside the continuation trims exactly; with no match the held tail is flushed."""
    deltas, got = run_stops(tok, "?\nAlice: It is red", stop)
    assert got == matched
    assert "".join(deltas) == expected


def test_held_tail_flushed_when_output_ends(tok):
    """C16 variant: generation ends right after a character that starts a stop string."""
    deltas, matched = run_stops(tok, "The sky is red?", ["?\n"])
    assert matched is None
    assert deltas[-2:] == ["", "?"]           # held while it could be "?\n", flushed at the end
    assert "".join(deltas) == "The sky is red?"


def _reference_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Character-by-character reference: stop at the first position where some stop string ends."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            s = max(hits, key=len)
            return text[:end - len(s)], s
    return text, None


@settings(max_examples=300, deadline=None)
@given(text=st.text("ab?\n", max_size=40), stops=st.lists(st.text("ab?\n", min_size=1, max_size=4),
       min_size=1, max_size=3), data=st.data())
def test_property_stop_matcher_chunking_independent(text, stops, data):
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=10)))
    chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)]) if b > a]
    matcher, sent, matched = StopStringMatcher(stops), "", None
    want_text, want_stop = _reference_stop(text, stops)
    for chunk in chunks:
        check = matcher.feed(chunk)
        sent += check.text
        assert want_text.startswith(sent), "released text that the final result drops"
        if check.matched:
            matched = check.matched
            break
    if matched is None:
        sent += matcher.flush()
    assert (sent, matched) == (want_text, want_stop)
