"""Offline API on the embedded default model: generate, chat, stream_chat, token prompts, n, stop, stats."""
from __future__ import annotations

from pathlib import Path

import pytest

import radixserve
from radixserve import LLM, SamplingParams
from radixserve.errors import ContextLengthExceeded, InvalidRequest


@pytest.fixture(scope="module")
def llm():
    return LLM(max_total_tokens=8192)


def test_generate_text_and_token_prompts_agree(llm):
    params = SamplingParams(max_tokens=12, temperature=0)
    text_out = llm.generate("The capital of France is", params, use_tqdm=False)[0]
    ids = llm.tokenizer.encode("The capital of France is")
    id_out = llm.generate([ids], params, use_tqdm=False)[0]
    assert text_out.prompt == "The capital of France is" and id_out.prompt is None
    assert text_out.prompt_token_ids == id_out.prompt_token_ids == ids
    assert text_out.outputs[0].token_ids == id_out.outputs[0].token_ids
    assert text_out.outputs[0].text == llm.tokenizer.decode(text_out.outputs[0].token_ids)
    assert id_out.num_cached_tokens > 0 or len(ids) <= 16  # second run hits the cache


def test_chat_names_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=32, temperature=0), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_stream_chat_deltas_add_up_to_the_chat_reply(llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(max_tokens=24, temperature=0)
    whole = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    deltas = list(llm.stream_chat(messages, params))
    assert len(deltas) > 1 and all(deltas)
    assert "".join(deltas) == whole
    with pytest.raises(ValueError):
        next(llm.stream_chat(messages, SamplingParams(n=2)))


def test_closing_a_stream_early_aborts_its_request(llm):
    aborted = llm.stats()["num_aborted_requests"]
    stream = llm.stream_chat([{"role": "user", "content": "Tell me a long story."}],
                             SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    next(stream)
    assert llm.engine.has_unfinished()
    stream.close()
    assert not llm.engine.has_unfinished()
    assert llm.stats()["num_aborted_requests"] == aborted + 1
    llm.engine.check_invariants()


def test_a_stop_string_ending_counts_as_finished(llm):
    """A stop string matched while the engine still generates ends the request early; it is a
    finished request in the counters, not an aborted one."""
    stats = llm.stats()
    out = llm.generate(["Here is the English alphabet: A B C"],
                       SamplingParams(max_tokens=12, temperature=0, stop=["D E F G"]), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop"
    after = llm.stats()
    assert after["num_aborted_requests"] == stats["num_aborted_requests"]
    assert after["num_finished_requests"] == stats["num_finished_requests"] + 1
    llm.engine.check_invariants()


def test_n_choices_share_the_prompt_and_differ(llm):
    prompt = "Write a short poem about the sea. " * 4
    out = llm.generate(prompt, SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=3),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate(prompt, SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=3),
                         use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_stop_string_trims_text(llm):
    full = llm.generate("1, 2, 3, 4, 5,", SamplingParams(max_tokens=16, temperature=0),
                        use_tqdm=False)[0].outputs[0]
    assert " 7" in full.text, full.text
    cut = llm.generate("1, 2, 3, 4, 5,", SamplingParams(max_tokens=16, temperature=0, stop=[" 7"]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.text == full.text[:full.text.index(" 7")]
    assert cut.finish_reason == "stop" and cut.stop_reason == " 7"


def test_bad_input_raises_and_leaves_engine_clean(llm):
    with pytest.raises(InvalidRequest):
        llm.generate("hi", SamplingParams(temperature=-1), use_tqdm=False)
    with pytest.raises(ContextLengthExceeded):
        llm.generate("hi", SamplingParams(max_tokens=10**6), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    llm.engine.check_invariants()
    stats = llm.stats()
    assert stats["num_running"] == 0 and 0.0 <= stats["cache_hit_rate"] <= 1.0
    assert stats["num_free_pages"] + stats["num_cached_pages"] == stats["num_pages"]


def test_readme_offline_example_prints_what_it_shows(llm, monkeypatch, capsys):
    """The README's offline snippet, run as written (on this module's engine, cache flushed so it
    starts as a fresh LLM() does), prints non-empty answers equal to its `# ...` comments."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    snippet = readme.split("Offline, in-process", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    expected = [line.split("# ", 1)[1] for line in snippet.splitlines() if line.startswith("print(")]
    assert len(expected) == 2, snippet
    assert llm.engine.flush_cache()
    monkeypatch.setattr(radixserve, "LLM", lambda *args, **kwargs: llm)
    exec(compile(snippet, "README.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed == expected and all(line.strip() for line in printed)
