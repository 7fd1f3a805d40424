"""The bytes bound on prompt tokens (issue 11, finding 3): sound for the tokenizers it is used
with, absent for those that may shorten text, and applied before any tokenizing."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.engine.messages import EngineInfo
from radixserve.errors import ContextLengthExceeded
from radixserve.server.protocol import ChatCompletionRequest, CompletionRequest
from radixserve.server.chat import chat_prompt
from radixserve.server.completions import completion_prompts
from radixserve.server.serving import ServingContext
from radixserve.tokenizer.text_bound import TextBound
from tests.unit.test_detokenizer import build_sentencepiece_tokenizer

CONTEXT = 512
TEN_MB = 10 * 1000 * 1000


@pytest.fixture(scope="module")
def sp_tok():
    return build_sentencepiece_tokenizer()


def test_bound_is_the_longest_piece(default_tokenizer, sp_tok):
    for tok in (default_tokenizer, sp_tok):
        longest = max(len(p.encode()) for p in tok.hf.get_vocab())
        assert tok.text_bound.bytes_per_token == longest
    assert b"\x16" in default_tokenizer.text_bound.dropped and not sp_tok.text_bound.dropped


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=300) | st.text(st.sampled_from(" \n\tab中é\x16\x04"), max_size=400))
def test_bound_is_sound(default_tokenizer, sp_tok, text):
    """No text takes fewer tokens than its bytes over the bound (what the refusal relies on)."""
    for tok in (default_tokenizer, sp_tok):
        assert len(tok.hf.encode(text, add_special_tokens=False)) >= tok.text_bound.min_tokens(text)


def test_no_bound_when_the_normalizer_may_shorten_text():
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def fast(normalizer=None, pre=None, model=None):
        raw = RawTokenizer(model or models.BPE({"a": 0, "[UNK]": 1}, [], unk_token="[UNK]"))
        if normalizer is not None:
            raw.normalizer = normalizer
        if pre is not None:
            raw.pre_tokenizer = pre
        return PreTrainedTokenizerFast(tokenizer_object=raw)

    assert TextBound.of(fast(normalizers.BertNormalizer())) is None
    assert TextBound.of(fast(normalizers.NFC())) is None
    assert TextBound.of(fast(normalizers.Replace("x", ""))) is None
    assert TextBound.of(fast(pre=pre_tokenizers.Whitespace())) is None
    assert TextBound.of(fast(model=models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))) is None
    assert TextBound.of(fast(model=models.BPE({"a": 0, "[UNK]": 1}, [], unk_token="[UNK]",
                                              fuse_unk=True))) is None
    assert TextBound.of(fast(pre=pre_tokenizers.ByteLevel())) == TextBound(len("[UNK]"))


def test_surrogates_count_without_raising():
    assert TextBound(2).min_tokens(json.loads('"\\ud800x"')) == 2   # 3 + 1 bytes


@settings(max_examples=300, deadline=None, derandomize=True)
@given(texts=st.lists(st.lists(st.sampled_from(["a", "\x16", "é", "中", "😀", "\ud800"]), max_size=40)
                      .map("".join), min_size=1, max_size=3), per_token=st.integers(1, 16))
def test_refused_exactly_when_the_bound_reaches_the_context(texts, per_token):
    """The check skips encoding short texts; it still refuses exactly when the bound's tokens reach the context."""
    bound = TextBound(per_token, b"\x16")
    client = SimpleNamespace(info=EngineInfo(max_context_len=8, page_size=16))
    ctx = ServingContext(client, SimpleNamespace(text_bound=bound), "tiny", "/tiny", max_open_requests=4)
    refuses = sum(bound.min_tokens(t) for t in texts) >= 8
    try:
        ctx.check_text_fits(texts, "prompt")
    except ContextLengthExceeded:
        assert refuses
    else:
        assert not refuses


class CountingTokenizer:
    """Wraps a Tokenizer; counts encode and chat-template calls."""

    def __init__(self, inner):
        self.inner = inner
        self.text_bound = inner.text_bound
        self.calls = 0

    def encode(self, text):
        self.calls += 1
        return self.inner.encode(text)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        self.calls += 1
        return self.inner.apply_chat_template(messages, add_generation_prompt)


def context(tokenizer) -> ServingContext:
    client = SimpleNamespace(info=EngineInfo(max_context_len=CONTEXT, page_size=16),
                             num_open_requests=0)
    return ServingContext(client, tokenizer, "tiny", "/tiny", max_open_requests=4)


def test_ten_megabyte_prompt_is_refused_before_tokenizing(default_tokenizer):
    tok = CountingTokenizer(default_tokenizer)
    ctx = context(tok)
    for prompt in ("x" * TEN_MB, ["Hi", "y" * TEN_MB]):
        req = CompletionRequest.model_validate({"prompt": prompt})
        with pytest.raises(ContextLengthExceeded) as err:
            asyncio.run(completion_prompts(ctx, req))
        assert err.value.param == "prompt" and str(CONTEXT) in err.value.message
    assert tok.calls == 0
    asyncio.run(completion_prompts(ctx, CompletionRequest.model_validate({"prompt": "Hi"})))
    assert tok.calls == 1


def test_ten_megabyte_chat_content_is_refused_before_rendering(default_tokenizer):
    tok = CountingTokenizer(default_tokenizer)
    ctx = context(tok)
    for content in ("x" * TEN_MB, [{"type": "text", "text": "z" * TEN_MB}]):
        req = ChatCompletionRequest.model_validate({"messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]})
        with pytest.raises(ContextLengthExceeded) as err:
            asyncio.run(chat_prompt(ctx, req))
        assert err.value.param == "messages"
    assert tok.calls == 0


def test_a_text_that_may_fit_is_tokenized(default_tokenizer):
    """Just under the bound: refused (if at all) by the token count, not the bytes."""
    tok = CountingTokenizer(default_tokenizer)
    ctx = context(tok)
    fits_by_bytes = "a" * (CONTEXT * default_tokenizer.text_bound.bytes_per_token - 200)
    prompts = asyncio.run(completion_prompts(ctx, CompletionRequest.model_validate(
        {"prompt": fits_by_bytes})))
    assert tok.calls == 1 and len(prompts[0]) > CONTEXT   # the engine refuses it by tokens
