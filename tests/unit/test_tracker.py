"""RequestTracker: n>1 fan-out, usage (C05), stop strings with abort (C15, C16), late outputs after finish."""
from __future__ import annotations


import pytest

from radixserve.errors import InvalidRequest
from radixserve.outputs import EngineOutput, TokenLogprob
from radixserve.sampling_params import SamplingParams
from radixserve.server.tracker import RequestTracker
from radixserve.tokenizer.tokenizer import Tokenizer

EOS = 2  # <|im_end|> in SmolLM2


@pytest.fixture(scope="module")
def tok(default_tokenizer) -> Tokenizer:
    return default_tokenizer


def lp(ids: list[int]) -> list[TokenLogprob]:
    return [TokenLogprob(token_id=t, logprob=-0.5, top=[(t, -0.5)]) for t in ids]


def out(rid, ids, finished=False, reason=None, stop_token_id=None, cached=0, logprobs=True, **kw):
    return EngineOutput(request_id=rid, new_token_ids=list(ids), new_logprobs=lp(ids) if logprobs else None,
                        finished=finished, finish_reason=reason, stop_token_id=stop_token_id,
                        num_cached_tokens=cached, **kw)


def drive(tracker, child, ids, final_reason=None, stop_token_id=None):
    """Send ids one per engine output (the last one finishing with final_reason); return updates."""
    ups = []
    for k, t in enumerate(ids):
        last = k == len(ids) - 1 and final_reason is not None
        ups.append(tracker.process(out(child, [t], finished=last, reason=final_reason if last else None,
                                       stop_token_id=stop_token_id if last else None)))
    return ups


def test_child_requests_fan_out_with_seeds(tok):
    params = SamplingParams(n=3, seed=7, temperature=0.8, stop=["x"], max_tokens=5)
    children = RequestTracker("req", [1, 2, 3], params, tok).child_requests()
    assert [c for c, _ in children] == ["req-0", "req-1", "req-2"]
    assert [p.seed for _, p in children] == [7, 8, 9]
    assert all(p.n == 1 and p.temperature == 0.8 and p.stop == ("x",) and p.max_tokens == 5
               for _, p in children)
    unseeded = RequestTracker("r", [1], SamplingParams(n=2), tok).child_requests()
    assert [p.seed for _, p in unseeded] == [None, None]


def test_n3_usage_counts_prompt_and_cache_once(tok):
    """C05: prompt_tokens once, completion_tokens summed, cached_tokens from choice 0 only."""
    prompt = tok.encode("Tell me a story about a cat")
    params = SamplingParams(n=3, max_tokens=4, logprobs=0)
    tracker = RequestTracker("r", prompt, params, tok)
    texts = [tok.encode(" Once upon a time"), tok.encode(" The cat"), tok.encode(" Meow")]
    tracker.process(out("r-0", texts[0][:1], cached=4))
    # Siblings may hit pages choice 0 just cached; only choice 0's count is reported, never a sum.
    tracker.process(out("r-1", texts[1][:1], cached=6))
    tracker.process(out("r-2", texts[2] + [EOS], finished=True, reason="stop", stop_token_id=EOS, cached=6))
    assert not tracker.finished
    tracker.process(out("r-0", texts[0][1:4], finished=True, reason="length", cached=4))
    assert not tracker.finished
    tracker.process(out("r-1", texts[1][1:], finished=True, reason="length", cached=6))
    assert tracker.finished
    assert tracker.prompt_tokens == len(prompt) >= 6
    assert tracker.cached_tokens == 4
    assert tracker.completion_tokens == 4 + len(texts[1]) + len(texts[2]) + 1  # eos counts
    result = tracker.result()
    assert [c.index for c in result.outputs] == [0, 1, 2]
    assert [c.finish_reason for c in result.outputs] == ["length", "length", "stop"]
    assert result.outputs[2].text == " Meow" and result.outputs[2].token_ids[-1] == EOS
    assert result.outputs[2].stop_reason is None      # EOS, as vLLM: only a stop_token_ids match is named
    assert result.outputs[0].text == tok.decode(texts[0][:4])
    assert all(len(c.logprobs) == len(c.token_ids) for c in result.outputs)
    assert result.num_cached_tokens == 4 and result.prompt_token_ids == prompt


def test_cached_tokens_never_exceed_prompt(tok):
    tracker = RequestTracker("r", [5, 6, 7], SamplingParams(max_tokens=1), tok)
    tracker.process(out("r-0", [28120], finished=True, reason="length", cached=64))
    assert tracker.cached_tokens == 3


def test_eos_ends_choice_without_text_even_unskipped(tok):
    params = SamplingParams(skip_special_tokens=False)
    tracker = RequestTracker("r", [1], params, tok)
    ids = tok.encode("Hello there") + [EOS]
    ups = drive(tracker, "r-0", ids, final_reason="stop", stop_token_id=EOS)
    assert "".join(u.text for u in ups) == "Hello there"
    assert ups[-1].finish_reason == "stop" and ups[-1].stop_reason is None and ups[-1].abort_child is None
    assert tracker.result().outputs[0].token_ids == ids
    assert tracker.result().outputs[0].logprobs is None  # not requested


def test_a_stop_token_id_the_client_named_is_the_stop_reason(tok):
    tracker = RequestTracker("r", [1], SamplingParams(stop_token_ids=(EOS,)), tok)
    ups = drive(tracker, "r-0", tok.encode("Hi") + [EOS], final_reason="stop", stop_token_id=EOS)
    assert (ups[-1].finish_reason, ups[-1].stop_reason) == ("stop", EOS)


def test_stop_string_aborts_child_and_ignores_late_tokens(tok):
    params = SamplingParams(n=2, stop=["D E F G"], logprobs=1)
    tracker = RequestTracker("r", [1], params, tok)
    ids = tok.encode(" A B C D E F G H I")
    ups = drive(tracker, "r-1", ids)
    stopped = [u for u in ups if u.finish_reason]
    assert len(stopped) == 1
    stop_update = stopped[0]
    assert stop_update.abort_child == "r-1" and stop_update.stop_reason == "D E F G"
    assert stop_update.index == 1
    assert "".join(u.text for u in ups) == " A B C "
    kept = tracker.result().outputs[1].token_ids
    assert kept == ids[:len(kept)] and tok.decode(kept).endswith(" G")  # up to the completing token
    late = tracker.process(out("r-1", tok.encode(" J K"), finished=True, reason="abort"))
    assert late.is_empty and late.finish_reason is None
    assert tracker.completion_tokens == len(kept)
    assert len(tracker.result().outputs[1].logprobs) == len(kept)
    assert not tracker.finished  # choice 0 is still running
    tracker.process(out("r-0", [], finished=True, reason="length"))
    assert tracker.finished


def test_stop_string_in_multi_token_output_trims_tokens_and_logprobs(tok):
    params = SamplingParams(stop=["sky"], include_stop_str_in_output=True, logprobs=0)
    tracker = RequestTracker("r", [1], params, tok)
    ids = tok.encode("The sky is red and the sky is blue")
    update = tracker.process(out("r-0", ids))
    assert update.text == "The sky" and update.finish_reason == "stop"
    assert update.token_ids == tok.encode("The sky") and len(update.logprobs) == len(update.token_ids)
    assert update.abort_child == "r-0"
    assert tracker.completion_tokens == len(update.token_ids)


def test_no_abort_when_engine_already_finished(tok):
    tracker = RequestTracker("r", [1], SamplingParams(stop=["!"]), tok)
    update = tracker.process(out("r-0", tok.encode("Hi! there"), finished=True, reason="length"))
    assert (update.text, update.finish_reason, update.stop_reason, update.abort_child) == ("Hi", "stop", "!", None)


BOB = "Alice: Ask me any question.\nBob: What color is the sky on Mars"


@pytest.mark.parametrize("stop, continuation, reason, text", [
    (["\n"], "?\nAlice: It is red", "stop", "?"),
    (["?\n"], "?\nAlice: It is red", "stop", ""),
    (["?\n"], "?", "length", "?"),          # max_tokens runs out right after a stop prefix
    (["\n"], "? Really", "length", "? Really"),
])
@pytest.mark.parametrize("separate_final", [False, True])
def test_c16_tail_flushed_stream_equals_final(tok, stop, continuation, reason, text, separate_final):
    """C16: scripted continuations of the Bob/Mars prompt; the streamed deltas equal the final text."""
    params = SamplingParams(stop=stop, max_tokens=8)
    tracker = RequestTracker("r", tok.encode(BOB), params, tok)
    ids = tok.encode(continuation)[:8]
    if separate_final:  # the finishing output carries no tokens
        ups = drive(tracker, "r-0", ids) + [tracker.process(out("r-0", [], finished=True, reason="length"))]
    else:
        ups = drive(tracker, "r-0", ids, final_reason="length")
    streamed = "".join(u.text for u in ups if not u.is_empty)
    assert streamed == text == tracker.result().outputs[0].text
    assert [u.finish_reason for u in ups if u.finish_reason] == [reason]


def test_c15_alphabet_stream_never_shows_stop_prefix(tok):
    tracker = RequestTracker("r", tok.encode("Here is the English alphabet: A B C"), SamplingParams(stop=["D E F G"]), tok)
    sent = ""
    for u in drive(tracker, "r-0", tok.encode(" D E F G H I J K")):
        sent += u.text
        assert "D" not in sent
    assert sent == " " and tracker.result().outputs[0].finish_reason == "stop"


def test_abort_from_engine_flushes_and_passes_error(tok):
    tracker = RequestTracker("r", [1], SamplingParams(stop=["?!"]), tok)
    first = tracker.process(out("r-0", tok.encode("Why?")))
    assert first.text == "Why"
    last = tracker.process(out("r-0", [], finished=True, reason="abort", error="client disconnected"))
    assert (last.text, last.finish_reason, last.error) == ("?", "abort", "client disconnected")


def test_prompt_logprobs_taken_from_first_output_that_has_them(tok):
    params = SamplingParams(n=2, prompt_logprobs=1)
    tracker = RequestTracker("r", [1, 2, 3], params, tok, prompt="abc")
    tracker.process(out("r-1", [28120]))
    tracker.process(out("r-0", [28120], prompt_logprobs=lp([2, 3])))
    tracker.process(out("r-1", [905], prompt_logprobs=lp([9, 9])))
    assert [x.token_id for x in tracker.prompt_logprobs] == [2, 3]
    assert tracker.result().prompt == "abc" and not tracker.result().finished


def test_foreign_request_id_is_rejected(tok):
    with pytest.raises(KeyError):
        RequestTracker("r", [1], SamplingParams(), tok).process(out("other-0", [1]))


@pytest.mark.parametrize("n", [0, 129])
def test_n_out_of_range_is_rejected_before_fan_out(tok, n):
    with pytest.raises(InvalidRequest) as err:
        RequestTracker("r", [1, 2], SamplingParams(n=n), tok)
    assert err.value.param == "n"


@pytest.mark.parametrize("stop", [[], ["ENDS"]])
def test_resume_at_every_cut_streams_what_an_uncut_run_does(tok, stop):
    """Stream migration: a tracker resumed after the first k tokens (their text sent by another
    worker) sends exactly the rest of the uncut stream, whatever k: held-back UTF-8 bytes and
    stop-string prefixes at the cut come out as they would have."""
    continuation = "Café 🙂 ok, EN then ENd and ENDS here"
    ids = tok.encode(continuation)
    params = SamplingParams(stop=stop, max_tokens=64)
    whole = RequestTracker("r", [1], params, tok)
    ups = drive(whole, "r-0", ids, final_reason="length")
    full = "".join(u.text for u in ups)
    for k in range(whole.completion_tokens):  # a stop string ends the uncut run early
        sent = "".join(u.text for u in ups[:k])
        resumed = RequestTracker("r", [1], params, tok)
        assert resumed.resume(ids[:k]) == sent, k
        rest = drive(resumed, "r-0", ids[k:], final_reason="length")
        assert sent + "".join(u.text for u in rest) == full, k
        assert resumed.result().outputs[0].text == full
        assert resumed.completion_tokens == whole.completion_tokens and resumed.prompt_tokens == 1


def test_resume_past_a_stop_string_is_refused(tok):
    tracker = RequestTracker("r", [1], SamplingParams(stop=["ok"]), tok)
    with pytest.raises(InvalidRequest):
        tracker.resume(tok.encode("fine, ok then"))
