"""Synthetic datasets generated locally from the tokenizer: random, shared-prefix, multi-turn, agent; each states its ideal reuse."""
from __future__ import annotations

import random

from radixserve.bench.workload import (ROLE_MARK, BenchRequest, Session, Workload, WordSource,
                                       make_request, range_lengths)


def random_dataset(source: WordSource, num_prompts: int, input_len: int, output_len: int,
                   range_ratio: float, seed: int) -> Workload:
    """Independent raw-text prompts of random words; lengths per `range_lengths` (SGLang's range ratio)."""
    rng = random.Random(seed)
    in_lens = range_lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = range_lengths(rng, output_len, range_ratio, num_prompts)
    sessions = []
    for n_in, n_out in zip(in_lens, out_lens):
        text = source.text(rng, n_in)
        sessions.append(Session((BenchRequest(text, ({"role": "user", "content": text},), n_in, n_out),)))
    info = {"random_input_len": input_len, "random_output_len": output_len,
            "random_range_ratio": range_ratio,
            "range_ratio_semantics": "sglang: lengths uniform in [max(int(L*r),1), L]; r=1 fixed",
            "theory_reuse": 0.0}
    return Workload("random", sessions, info)


def shared_prefix_dataset(source: WordSource, num_groups: int, prompts_per_group: int,
                          system_prompt_len: int, question_len: int, output_len: int,
                          seed: int) -> Workload:
    """`num_groups` system prompts x `prompts_per_group` questions, shuffled (SGLang's
    generated-shared-prefix). Ideal reuse: (P - 1) / P * (S + m_user) / prompt_len."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_groups):
        system = source.text(rng, system_prompt_len)
        for _ in range(prompts_per_group):
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": source.text(rng, question_len)}]
            requests.append(make_request(messages, output_len, source))
    rng.shuffle(requests)
    shared = system_prompt_len + source.count(ROLE_MARK["user"])
    prompt_len = shared + question_len + source.count(ROLE_MARK["assistant"])
    theory = (prompts_per_group - 1) / prompts_per_group * shared / prompt_len
    info = {"gsp_num_groups": num_groups, "gsp_prompts_per_group": prompts_per_group,
            "gsp_system_prompt_len": system_prompt_len, "gsp_question_len": question_len,
            "gsp_output_len": output_len, "shared_prefix_len": shared, "theory_reuse": theory}
    return Workload("shared-prefix", [Session((r,)) for r in requests], info)


def _conversation(source: WordSource, rng: random.Random, head: list[dict[str, str]],
                  first_user_len: int, turns: int, turn_role: str, turn_len: int,
                  output_len: int) -> tuple[BenchRequest, ...]:
    """Turn k's prompt = turn k-1's + the reference answer + a new `turn_role` message."""
    messages = [*head, {"role": "user", "content": source.text(rng, first_user_len)}]
    requests = [make_request(messages, output_len, source)]
    for _ in range(turns - 1):
        messages += [{"role": "assistant", "content": source.text(rng, output_len)},
                     {"role": turn_role, "content": source.text(rng, turn_len)}]
        requests.append(make_request(messages, output_len, source))
    return tuple(requests)


def _chain_reuse(prompt_lens: list[list[int]], first_hits: list[int]) -> float:
    """Ideal reuse when turn k reuses turn k-1's prompt and session i's turn 1 reuses first_hits[i]."""
    hit = sum(first_hits) + sum(sum(lens[:-1]) for lens in prompt_lens)
    return hit / sum(sum(lens) for lens in prompt_lens)


def multi_turn_dataset(source: WordSource, num_clients: int, num_rounds: int, system_prompt_len: int,
                       user_len: int, output_len: int, seed: int) -> Workload:
    """`num_clients` chats x `num_rounds` rounds, prompt = history + user turn: L_k = S+k(m_u+U)+(k-1)(m_a+O)+m_a."""
    rng = random.Random(seed)
    sessions = []
    for _ in range(num_clients):
        head = [{"role": "system", "content": source.text(rng, system_prompt_len)}] if system_prompt_len else []
        sessions.append(Session(_conversation(source, rng, head, user_len, num_rounds, "user",
                                              user_len, output_len)))
    m_u, m_a = source.count(ROLE_MARK["user"]), source.count(ROLE_MARK["assistant"])
    lens = [system_prompt_len + k * (m_u + user_len) + (k - 1) * (m_a + output_len) + m_a
            for k in range(1, num_rounds + 1)]
    info = {"num_clients": num_clients, "num_rounds": num_rounds, "system_prompt_len": system_prompt_len,
            "user_len": user_len, "output_len": output_len,
            "theory_reuse": _chain_reuse([lens] * num_clients, [0] * num_clients)}
    return Workload("multi-turn", sessions, info)


def agent_dataset(source: WordSource, num_sessions: int, num_turns: int, context_len: int,
                  task_len: int, tool_len: int, output_len: int, seed: int,
                  num_contexts: int = 1) -> Workload:
    """Coding-agent sessions: repository context i % num_contexts, a task, then turns appending the
    answer and a tool result. Raises ValueError unless 1 <= num_contexts <= num_sessions."""
    if not 1 <= num_contexts <= num_sessions:
        raise ValueError(f"num_contexts must be in [1, num_sessions], got {num_contexts}")
    rng = random.Random(seed)
    heads = [[{"role": "system", "content": source.text(rng, context_len)}] for _ in range(num_contexts)]
    sessions = [Session(_conversation(source, rng, heads[i % num_contexts], task_len, num_turns, "tool",
                                      tool_len, output_len)) for i in range(num_sessions)]
    m_u, m_a, m_t = (source.count(ROLE_MARK[r]) for r in ("user", "assistant", "tool"))
    first = context_len + m_u + task_len + m_a
    lens = [first + (k - 1) * (output_len + m_t + tool_len + m_a) for k in range(1, num_turns + 1)]
    first_hits = [0 if i < num_contexts else context_len + m_u for i in range(num_sessions)]
    info = {"num_sessions": num_sessions, "num_turns": num_turns, "context_len": context_len,
            "num_contexts": num_contexts, "task_len": task_len, "tool_len": tool_len,
            "output_len": output_len, "theory_reuse": _chain_reuse([lens] * num_sessions, first_hits)}
    return Workload("agent", sessions, info)
