"""The gated delta rule on CUDA through `fla-core` (optional `gpu` extra): the same signatures
as `kernels.gated_delta_reference`, states at cut positions by running segments in rounds.

fla takes one flat batch (`[1, T, H, *]` with `cu_seqlens`) and value-head-shared q/k are
expanded first, so its own grouped-head support is not relied on. fla's chunked kernel refuses
fp32 inputs: fp32 prefill runs the torch reference instead (fp32 models are for parity runs).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from fla.ops.gated_delta_rule import (
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
)

from kernels.gated_delta_reference import (
    DeltaRuleInputs,
    DeltaRuleOutput,
    reference_chunked_core,
    run_with_cuts,
)


def _fla_core(
    inputs: DeltaRuleInputs, states: torch.Tensor, starts: list[int], scale: float, chunked: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if chunked and inputs.v.dtype == torch.float32:
        return reference_chunked_core(inputs, states, starts, scale)
    ratio = inputs.v.shape[1] // inputs.q.shape[1]
    q, k = (x.repeat_interleave(ratio, dim=1) for x in (inputs.q, inputs.k))
    cu_seqlens = torch.tensor(starts, dtype=torch.long, device=q.device)
    fn = chunk_gated_delta_rule if chunked else fused_recurrent_gated_delta_rule
    # By keyword: fla-core 0.6 put per-key and per-value decays (gk, gv) between g and beta.
    out, final = fn(
        q[None], k[None], inputs.v[None], g=inputs.g[None].float(),
        beta=inputs.beta[None].to(q.dtype), scale=scale,
        initial_state=states.float().contiguous(), output_final_state=True, cu_seqlens=cu_seqlens,
    )  # fmt: skip
    return out[0], final


def chunked_gated_delta_rule(
    inputs: DeltaRuleInputs,
    initial_states: torch.Tensor,
    query_start_loc: torch.Tensor | Sequence[int],
    scale: float,
    cut_positions: Sequence[int] = (),
    chunk_size: int = 64,
) -> DeltaRuleOutput:
    """fla's chunked kernel (its own chunk size; `chunk_size` is the reference's)."""
    core = functools.partial(_fla_core, chunked=True)
    return run_with_cuts(core, inputs, initial_states, query_start_loc, scale, cut_positions)


def recurrent_gated_delta_rule(
    inputs: DeltaRuleInputs,
    initial_states: torch.Tensor,
    query_start_loc: torch.Tensor | Sequence[int],
    scale: float,
    cut_positions: Sequence[int] = (),
) -> DeltaRuleOutput:
    """fla's fused recurrent kernel (decode steps)."""
    core = functools.partial(_fla_core, chunked=False)
    return run_with_cuts(core, inputs, initial_states, query_start_loc, scale, cut_positions)
