"""The count gate's fixed, seeded request sets: multi-turn chats, shared-prefix groups, random prompts, agents on several repositories.

Everything is token ids drawn from `random.Random(seed)`; arrivals are step numbers, never
seconds, so a set is the same on every machine. A conversation is a chain of turns: turn k + 1
arrives `think_steps` steps after turn k finished, and its prompt is turn k's prompt + turn k's
answer + new user tokens, so the turns' prompts grow exactly as a chat client's do.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

VOCAB_SIZE = 1000
EOS_ID = 0   # never drawn into prompts; the fake model ends an answer with it now and then


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a conversation: `user_ids` are appended to the history (for the first
    turn, the whole prompt); the answer is at most `max_tokens` tokens."""

    user_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Conversation:
    """Turns sent one after another by one client, the first at step `arrival_step`; each
    later turn `think_steps` steps after the previous one finished. A single-turn conversation
    is an ordinary request."""

    name: str
    arrival_step: int
    turns: tuple[Turn, ...]
    think_steps: int = 2


def _ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1, VOCAB_SIZE) for _ in range(n))


def multi_turn(seed: int = 1, num_clients: int = 6, num_turns: int = 4) -> list[Conversation]:
    """Chats: a 48-token opening, then 16-32 new user tokens a turn; answers of 16-32 tokens.
    Client i starts at step 3 * i."""
    rng = random.Random(seed)
    return [Conversation(f"chat{i}", 3 * i, tuple(
        Turn(_ids(rng, 48 if k == 0 else rng.randint(16, 32)), rng.randint(16, 32))
        for k in range(num_turns))) for i in range(num_clients)]


def shared_prefix(seed: int = 2, num_groups: int = 3, per_group: int = 6,
                  prefix_len: int = 96) -> list[Conversation]:
    """Few-shot prompts: each group's requests share one `prefix_len`-token prefix and add an
    8-24 token question; answers of 8-24 tokens. One request a step, groups interleaved."""
    rng = random.Random(seed)
    prefixes = [_ids(rng, prefix_len) for _ in range(num_groups)]
    return [Conversation(f"fewshot{g}.{j}", j * num_groups + g,
                         (Turn(prefixes[g] + _ids(rng, rng.randint(8, 24)), rng.randint(8, 24)),))
            for j in range(per_group) for g in range(num_groups)]


def random_prompts(seed: int = 3, num_requests: int = 16) -> list[Conversation]:
    """Unrelated prompts of 16-128 tokens with answers of 8-48 tokens, one every 2 steps."""
    rng = random.Random(seed)
    return [Conversation(f"random{i}", 2 * i, (Turn(_ids(rng, rng.randint(16, 128)),
                                                    rng.randint(8, 48)),))
            for i in range(num_requests)]


def agent_repos(seed: int = 4, num_sessions: int = 8, num_turns: int = 4, num_repos: int = 4,
                repo_len: int = 160) -> list[Conversation]:
    """Coding agents: session i works on repository i % num_repos (a `repo_len`-token context)
    with a 16-token task, then tool results of 24-40 tokens a turn; answers of 8-16 tokens.
    Session i starts at step 24 * i, so two or three are in flight."""
    rng = random.Random(seed)
    repos = [_ids(rng, repo_len) for _ in range(num_repos)]
    return [Conversation(f"agent{i}", 24 * i, tuple(
        Turn(repos[i % num_repos] + _ids(rng, 16) if k == 0 else _ids(rng, rng.randint(24, 40)),
             rng.randint(8, 16)) for k in range(num_turns))) for i in range(num_sessions)]


def mixed() -> list[Conversation]:
    """All three sets at once, in arrival order (ties: chats, then few-shot, then random)."""
    sets = multi_turn() + shared_prefix() + random_prompts()
    return sorted(sets, key=lambda c: c.arrival_step)
