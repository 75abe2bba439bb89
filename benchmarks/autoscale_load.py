"""The load of the autoscaling benchmark: multi-turn chat conversations with a shared system
prompt, as many at once as the current phase asks, through a Serve deployment handle.

    phases [(concurrency, seconds), ...] ─► one worker per conversation slot below the phase's
        concurrency; a worker runs conversations of `turns` turns, thinking between turns, and
        leaves after its turn when its slot is above the concurrency (the lower slots' go on)
    each turn ─► Turn(started, TTFT, prompt / cached / history tokens, error)
    meanwhile ─► the deployment's running replicas, polled each second

A turn's history is what it shares with its conversation's previous turn as the replica saw it
(that prompt and its answer, tokenized as the replicas do; the chat template may drop the
generation prompt from the history), in whole blocks and short of the prompt's last token: what
the turn recomputes of it is the history not served from a cache.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

from ray import serve

from cluster.openai_api.protocol import ChatCompletionRequest

SYSTEM = " ".join(f"t{40 + i % 150}" for i in range(48))
"""The system prompt every conversation shares (48 words)."""


@dataclass(frozen=True)
class LoadShape:
    """What each conversation sends."""

    model: str
    turns: int = 6
    user_words: int = 8
    max_tokens: int = 8
    think_s: tuple[float, float] = (1.0, 3.0)
    block_size: int = 4


@dataclass(frozen=True)
class Turn:
    """One request's outcome."""

    started: float
    ttft_s: float | None
    prompt_tokens: int
    cached_tokens: int
    history_tokens: int
    """Tokens of the prompt the conversation's previous turn left cacheable (0 for a first
    turn)."""
    error: str | None

    @property
    def recomputed(self) -> int:
        """History tokens this turn computed again."""
        return max(0, self.history_tokens - self.cached_tokens)


@dataclass
class Ramp:
    """A running ramp: the current concurrency, the turns so far, the replica counts."""

    handle: Any
    shape: LoadShape
    tokenizer: Any = None
    """The model's tokenizer (None: no history measured)."""
    concurrency: int = 0
    turns: list[Turn] = field(default_factory=list)
    replicas: list[tuple[float, int, int]] = field(default_factory=list)
    """(time, replicas running, replicas running or starting)."""
    phase_starts: list[tuple[float, int]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def now(self) -> float:
        return time.monotonic() - self.started


async def run_ramp(ramp: Ramp, phases: list[tuple[int, float]], app: str, deployment: str) -> None:
    """Drive the phases, then wait for the workers' last turns."""
    workers: dict[int, asyncio.Task[None]] = {}
    poller = asyncio.create_task(_poll_replicas(ramp, app, deployment))
    for concurrency, seconds in phases:
        ramp.concurrency = concurrency
        ramp.phase_starts.append((ramp.now(), concurrency))
        for slot in range(concurrency):
            if slot not in workers or workers[slot].done():
                workers[slot] = asyncio.create_task(_worker(ramp, slot))
        await asyncio.sleep(seconds)
    ramp.concurrency = 0
    await asyncio.gather(*workers.values())
    poller.cancel()


async def _worker(ramp: Ramp, slot: int) -> None:
    rng = random.Random(slot)
    number = 0
    while slot < ramp.concurrency:
        await _conversation(ramp, slot, number, rng)
        number += 1


async def _conversation(ramp: Ramp, slot: int, number: int, rng: random.Random) -> None:
    shape = ramp.shape
    messages = [{"role": "system", "content": SYSTEM}]
    previous: list[int] = []
    for turn in range(shape.turns):
        if slot >= ramp.concurrency:
            return
        words = [f"t{(7 * slot + 13 * number + 3 * turn + i) % 200 + 20}" for i in range(8)]
        messages.append({"role": "user", "content": " ".join(words[: shape.user_words])})
        request_id = f"c{slot}-{number}-{turn}-{random.getrandbits(32):x}"
        history = shared_history(ramp, messages, previous)
        outcome, text, previous = await one_turn(ramp, messages, request_id, history)
        ramp.turns.append(outcome)
        if outcome.error is not None:
            return
        messages.append({"role": "assistant", "content": text})
        await asyncio.sleep(rng.uniform(*shape.think_s))


def shared_history(ramp: Ramp, messages: list[dict[str, str]], previous: list[int]) -> int:
    """The prompt's tokens a cache of `previous` (the last turn's prompt and answer) can serve:
    their common prefix in whole blocks, short of the prompt's last token."""
    if ramp.tokenizer is None or not previous:
        return 0
    prompt = prompt_token_ids(ramp.tokenizer, messages)
    common = 0
    for a, b in zip(prompt, previous, strict=False):
        if a != b:
            break
        common += 1
    block = ramp.shape.block_size
    return min(common, len(prompt) - 1) // block * block


async def one_turn(
    ramp: Ramp, messages: list[dict[str, str]], request_id: str, history: int
) -> tuple[Turn, str, list[int]]:
    """Stream one greedy turn: its outcome, its text, and its prompt and answer tokens."""
    shape = ramp.shape
    request = ChatCompletionRequest(
        model=shape.model, messages=messages, max_tokens=shape.max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    started = time.monotonic()
    ttft = None
    pieces: list[str] = []
    usage = None
    try:
        stream = ramp.handle.options(stream=True).generate.remote(request, request_id, False)
        async for chunk in stream:
            if not hasattr(chunk, "choices"):  # an error body
                raise RuntimeError(str(chunk))
            if ttft is None and chunk.choices:
                ttft = time.monotonic() - started
            pieces.extend(c.delta.content or "" for c in chunk.choices)
            usage = chunk.usage or usage
    except Exception as error:  # every failure is counted, none stops the ramp
        failed = Turn(started - ramp.started, None, 0, 0, history, repr(error)[:200])
        return failed, "", []
    if usage is None:
        return Turn(started - ramp.started, ttft, 0, 0, history, "no usage"), "", []
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    outcome = Turn(started - ramp.started, ttft, usage.prompt_tokens, cached, history, None)
    text = "".join(pieces)
    return outcome, text, _tokens(ramp, messages, text)


def prompt_token_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The chat prompt's token IDs as the replicas make them (generation prompt added)."""
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return [int(token) for token in ids]


def _tokens(ramp: Ramp, messages: list[dict[str, str]], answer: str) -> list[int]:
    """A turn's prompt and answer as the replica held them."""
    if ramp.tokenizer is None:
        return []
    prompt = prompt_token_ids(ramp.tokenizer, messages)
    return [*prompt, *ramp.tokenizer.encode(answer, add_special_tokens=False)]


async def _poll_replicas(ramp: Ramp, app: str, deployment: str) -> None:
    while True:
        running, wanted = await asyncio.to_thread(replica_counts, app, deployment)
        ramp.replicas.append((ramp.now(), running, wanted))
        await asyncio.sleep(1.0)


def replica_counts(app: str, deployment: str) -> tuple[int, int]:
    """The deployment's replicas running, and those running or starting (Serve's status)."""
    status = serve.status().applications.get(app)
    if status is None or deployment not in status.deployments:
        return 0, 0
    states = status.deployments[deployment].replica_states
    wanted = sum(count for state, count in states.items() if state != "STOPPING")
    return int(states.get("RUNNING", 0)), int(wanted)
