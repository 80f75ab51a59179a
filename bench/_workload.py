"""The request sequence every cache benchmark replays (refcache and SGLang alike), generated deterministically.

Shape (``chat_workload()`` defaults): 1,500 requests, 1,019,347 tokens in all (mean 680, at most 1,536).
12 shared system prompts of 100-600 tokens, picked with Zipf-like popularity; conversations (549 started)
open on one of them, and each turn is the whole previous turn (prompt and answer) plus a user message
(20-120 tokens) and an answer (30-200 tokens), so a turn's prefix is the previous request; up to 24 run
interleaved (a random live one takes the next turn) and each ends after a turn with probability 1/3 or at
1,536 tokens; 8% of requests repeat an earlier request exactly; 5% are one-shot requests on a system
prompt. Tokens are ids below 32,000; no namespace. A seeded ``random.Random`` makes the sequence identical
on every run and in every interpreter.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["Workload", "chat_workload"]


@dataclass(frozen=True)
class Workload:
    requests: tuple[tuple[int, ...], ...]
    description: str

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.requests)


def chat_workload(
    requests: int = 1500, *, seed: int = 17, conversations: int = 600, max_len: int = 1536
) -> Workload:
    rng = random.Random(seed)
    vocab = 32_000

    def text(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(1, vocab) for _ in range(n))

    prompts = [text(rng.randrange(100, 600)) for _ in range(12)]
    weights = [1.0 / (i + 1) for i in range(len(prompts))]
    live: list[list[int]] = []  # running conversations: their token history
    started = 0
    out: list[tuple[int, ...]] = []
    while len(out) < requests:
        roll = rng.random()
        if roll < 0.08 and out:
            out.append(out[rng.randrange(len(out))])  # an exact repeat
            continue
        if roll < 0.13:
            (prompt,) = rng.choices(prompts, weights)
            out.append(prompt + text(rng.randrange(20, 200)))  # one-shot on a shared prompt
            continue
        if started < conversations and (len(live) < 24 or rng.random() < 0.4):
            (prompt,) = rng.choices(prompts, weights)
            live.append(list(prompt))
            started += 1
        if not live:
            continue
        i = rng.randrange(len(live))
        history = live[i]
        history.extend(text(rng.randrange(20, 120)))  # the user's message
        history.extend(text(rng.randrange(30, 200)))  # the answer
        out.append(tuple(history[:max_len]))
        if len(history) >= max_len or rng.random() < 1 / 3:
            live.pop(i)
    w = tuple(out)
    total = sum(len(r) for r in w)
    return Workload(
        w,
        f"chat workload seed {seed}: {len(w)} requests, {total:,} tokens, 12 system prompts, "
        f"{started} conversations, 8% repeats",
    )
