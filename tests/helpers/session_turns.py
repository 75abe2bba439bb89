"""Chat-like sessions taking turns on one engine: the workload of the KV offload tier tests.

Each session starts with 16 tokens; in every round each session in turn adds 8 new tokens to its
history, generates 4 and appends them. Even sessions decode greedily, odd ones sample with a
seed of their own, so tiered and untiered runs can be compared token for token.
"""

from __future__ import annotations

from cluster import LLM, SamplingParams


def turn_params(session: int, round_index: int) -> SamplingParams:
    """Greedy for even sessions, seeded sampling for odd ones."""
    if session % 2 == 0:
        return SamplingParams(temperature=0, max_tokens=4)
    return SamplingParams(temperature=1.0, max_tokens=4, seed=100 * session + round_index)


def session_turns(llm: LLM, num_sessions: int, num_rounds: int) -> list[list[int]]:
    """Tokens of every turn, session after session in each round."""
    histories = [[(5 * s + 3 * i) % 250 + 1 for i in range(16)] for s in range(num_sessions)]
    tokens = []
    for round_index in range(num_rounds):
        for session, history in enumerate(histories):
            history.extend([(31 * session + 7 * round_index + i) % 250 + 1 for i in range(8)])
            params = turn_params(session, round_index)
            (result,) = llm.generate([{"prompt_token_ids": history}], params, use_tqdm=False)
            output = list(result.outputs[0].token_ids)
            tokens.append(output)
            history.extend(output)
    return tokens
