"""The model runner: one step of the model from a `SchedulerOutput` to a `ModelRunnerOutput`.

`execute` reads as: update states from the output -> build the input batch -> build attention
metadata per attention group -> forward -> logits at the logits indices -> sample -> output.
Memory planning and process setup live in the worker; this class owns the per-request state,
the attention groups, the KV cache views and the sampler.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch
from torch import nn

from kernels import AttentionBackend, select_backend
from kernels.kv_quant import is_fp8, kv_cache_torch_dtype
from kernels.mamba_registry import select_mamba_kernels
from scheduler.kv_cache.builder import group_of_layer
from scheduler.kv_cache.spec import KVCacheConfig, MambaCacheMode
from scheduler.lora import LoRARequest
from scheduler.output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from worker.attention.attention import ForwardContext, KernelNeeds
from worker.attention.attention_groups import (
    AttentionGroup,
    GroupingOptions,
    MetadataBuildStats,
    build_attention_groups,
    build_forward_context,
)
from worker.attention.block_table import MultiGroupBlockTable
from worker.attention.kv_scales import prepare_kv_scales
from worker.attention.metadata_transforms import StepRows
from worker.block_copies import GroupTensors, copy_blocks, group_tensors, saves_by_request
from worker.distributed import broadcast_token_lists
from worker.grammar_mask import GrammarMask
from worker.graphs.decode_graphs import DecodeGraphs, decode_graphs_for
from worker.input_batch import (
    CachedRequestState,
    InputBatch,
    RequestStates,
    build_input_batch,
    scheduled_req_ids,
)
from worker.kv_cache import (
    KVCaches,
    KVCacheSpecReport,
    allocate_kv_caches,
    attention_layers,
    check_kv_cache_dtype,
    report_kv_cache_specs,
)
from worker.kv_io.offload_store import HostOffloadStore
from worker.lora.manager import LoRAManager
from worker.multimodal import ImageStep, takes_images
from worker.prompt_logprobs import prompt_logprob_rows, prompt_logprobs
from worker.runner_config import RunnerConfig
from worker.sampler import Sampler
from worker.sampling_state import SamplingState
from worker.spec_decode.draft_states import DrafterStateGroups
from worker.spec_decode.factory import make_proposer
from worker.spec_decode.proposer import DrafterCache, DraftProposer
from worker.spec_decode.ranks import run_proposer
from worker.spec_decode.verify import RowLayout, verify_drafts
from worker.state.mamba_cache import mamba_layers, model_order_specs, resolve_state_dtype
from worker.state.mamba_metadata import build_mamba_metadata, checkpoint_cuts, mamba_group_modes

logger = logging.getLogger(__name__)


class CausalLM(Protocol):
    """The model interface the runner uses (an `nn.Module` holding `Attention` layers)."""

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def modules(self) -> Iterator[nn.Module]: ...


@dataclass(frozen=True)
class ModelSettings:
    """What the runner needs to know about the model beyond the module itself."""

    dtype: torch.dtype
    """Dtype of activations and of the KV cache."""
    max_model_len: int
    """Longest request; sizes the block-table rows."""
    eos_token_ids: tuple[int, ...] = ()
    """Tokens that end generation unless a request ignores EOS (masked before min_tokens)."""


class ModelRunner:
    """Runs one worker rank's share of the model for each scheduler step."""

    def __init__(
        self,
        model: CausalLM,
        settings: ModelSettings,
        config: RunnerConfig,
        device: torch.device,
        is_driver: bool = True,
        drafter: nn.Module | None = None,
    ) -> None:
        """`drafter`: the draft model or MTP layer of speculative decoding."""
        self.model = model
        self.settings = settings
        self.config = config
        self.device = device
        self.is_driver = is_driver
        """Only the driver rank samples and returns outputs; other ranks run the forward."""
        self.proposer: DraftProposer | None = (
            make_proposer(config.speculative, drafter) if config.speculative else None
        )
        """Proposes the drafts the next step verifies (None: no speculation); a drafter model
        runs on every rank, other proposers on the driver only."""
        self.drafter_layers = self.proposer.drafter_layers if self.proposer else []
        """Attention layers of the proposer's model: KV cache groups of their own."""
        self.layers = attention_layers(model) + self.drafter_layers
        self.drafter_state_layers = self.proposer.drafter_state_layers if self.proposer else []
        """Recurrent-state layers of the proposer's model: state groups of their own."""
        self.mamba_layers = mamba_layers(model) + self.drafter_state_layers
        self._mamba_groups: dict[str, int] = {}
        """Mamba layer -> its KV cache group."""
        self._mamba_modes: dict[int, tuple[int, MambaCacheMode]] = {}
        self._mamba_kernels = select_mamba_kernels("torch", device)
        self.state_dtype = resolve_state_dtype(config.mamba_ssm_cache_dtype, settings.dtype)
        """Dtype of recurrent and conv state pages (`mamba_ssm_cache_dtype`)."""
        self.kv_cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, settings.dtype)
        """Dtype of attention KV pages (`kv_cache_dtype`: the model dtype, or fp8)."""
        self.sampler = Sampler(config.seed, device)
        self.sampling_state = SamplingState(device, settings.eos_token_ids)
        self.attention_groups: list[AttentionGroup] = []
        self.kv_caches: KVCaches = {}
        self._group_tensors: GroupTensors = {}
        """Every cache tensor of each KV cache group (block copies)."""
        self._num_blocks = 0
        self.offload: HostOffloadStore | None = None
        """Block pages of the offload tier in host memory (after `initialize_kv_cache`)."""
        self.states: RequestStates | None = None
        self.build_stats = MetadataBuildStats()
        self._backends: dict[tuple[int, KernelNeeds], AttentionBackend] = {}
        self.lora: LoRAManager | None = (
            LoRAManager(model, config.lora, device) if config.lora is not None else None  # type: ignore[arg-type]
        )
        """The adapters' host copies and device slots (None: LoRA off)."""
        self.images = ImageStep(model, device) if takes_images(model) else None  # type: ignore[arg-type]
        self.graphs: DecodeGraphs | None = None
        """Uniform decode steps from static buffers, as CUDA graphs (after the KV cache)."""

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one attention KV element."""
        return self.kv_cache_dtype.itemsize

    def kv_cache_specs(self) -> KVCacheSpecReport:
        """Per-layer KV specs of this rank at the configured block size (Mamba layers too)."""
        check_kv_cache_dtype(self.config.kv_cache_dtype, self.layers, type(self.model).__name__)
        block_size, dtype_bytes = self.config.block_size, self.dtype_bytes
        target = attention_layers(self.model)
        report = report_kv_cache_specs(target + self.drafter_layers, block_size, dtype_bytes)
        specs = report.layer_specs
        mode = MambaCacheMode(self.config.mamba_cache_mode)
        state_bytes = self.state_dtype.itemsize
        if self.mamba_layers:
            specs = model_order_specs(self.model, specs, block_size, state_bytes, mode)
        for layer in self.drafter_layers:  # after the target's, in groups of their own
            name = layer.layer_name
            specs[name] = replace(report.layer_specs[name], drafter=True)
        for state in self.drafter_state_layers:
            spec = state.kv_cache_spec(block_size, state_bytes, mode)
            specs[state.layer_name] = replace(spec, drafter=True)
        return replace(report, layer_specs=specs)

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Build attention groups, allocate and bind the KV caches, size the block tables."""
        options = GroupingOptions(
            dtype_bytes=self.dtype_bytes,
            kv_sharing_fast_prefill=self.config.kv_sharing_fast_prefill,
        )
        self.attention_groups = build_attention_groups(
            self.layers, kv_cache_config, self._backend_for, options
        )
        kernel_sizes = [group.spec.block_size for group in kv_cache_config.groups]
        for attn_group in self.attention_groups:
            kernel_sizes[attn_group.kv_cache_group_id] = attn_group.kernel_block_size
        self.kv_caches = allocate_kv_caches(
            kv_cache_config, kernel_sizes, self.kv_cache_dtype, self.device, self.state_dtype
        )
        prepare_kv_scales(
            self.layers, self.config.calculate_kv_scales and is_fp8(self.kv_cache_dtype)
        )
        tables = MultiGroupBlockTable(
            kv_cache_config.block_sizes,
            kernel_sizes,
            self.config.max_num_seqs,
            self.settings.max_model_len,
        )
        self.states = RequestStates(tables, self.device)
        group_of = group_of_layer(kv_cache_config)
        self._mamba_groups = {
            layer.layer_name: group_of[layer.layer_name] for layer in self.mamba_layers
        }
        self._mamba_modes = mamba_group_modes(kv_cache_config)
        self._group_tensors = group_tensors(kv_cache_config, self.kv_caches)
        self._num_blocks = kv_cache_config.num_blocks
        self.offload = HostOffloadStore(
            self._group_tensors,
            self._num_blocks,
            self.device,
            self.config.offload_load_timeout_s,
        )
        self._mamba_kernels = select_mamba_kernels(self.config.attention_backend, self.device)
        if self.proposer is not None:
            self.proposer.bind(self._drafter_cache())
        self.graphs = decode_graphs_for(self, self.config.cuda_graphs)
        self.rebuild_cuda_graphs()
        logger.info(
            "KV cache bound: %d KV cache groups, %d attention groups, kernel block sizes %s",
            len(kv_cache_config.groups),
            len(self.attention_groups),
            kernel_sizes,
        )

    def rebuild_cuda_graphs(self) -> None:
        """Drop and capture the decode graphs again (after weights or caches moved)."""
        if self.graphs is not None:
            self.graphs.rebuild()

    def _drafter_cache(self) -> DrafterCache:
        names = {layer.layer_name for layer in self.drafter_layers}
        groups = [group for group in self.attention_groups if names.issuperset(group.layer_names)]
        state_groups = None
        if self.drafter_state_layers:
            group_of = {
                layer.layer_name: self._mamba_groups[layer.layer_name]
                for layer in self.drafter_state_layers
            }
            state_groups = DrafterStateGroups(group_of, self._mamba_modes, self._mamba_kernels)
        return DrafterCache(groups, self.kv_caches, self._require_states(), state_groups)

    def _backend_for(self, kernel_block_size: int, needs: KernelNeeds) -> AttentionBackend:
        key = (kernel_block_size, needs)
        if key not in self._backends:
            self._backends[key] = select_backend(
                self.config.attention_backend,
                device=self.device,
                block_size=kernel_block_size,
                head_size=needs.head_size,
                dtype=self.settings.dtype,
                has_sinks=needs.has_sinks,
                keys_from_values=needs.keys_from_values,
                kv_cache_dtype=self.kv_cache_dtype,
            )
        return self._backends[key]

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step, after its offload-tier copies; an output with no scheduled tokens only
        updates the states (and reports loads)."""
        offload = scheduler_output.offload
        report = self._require_offload().run(offload, scheduler_output.finished_req_ids)
        output = self._run_step(scheduler_output)
        if not (report.finished or report.failed):
            return output
        return replace(
            output,
            finished_loads=report.finished,
            failed_loads=report.failed,
            load_seconds=report.load_seconds,
        )

    def _run_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        states = self._require_states()
        states.update(scheduler_output)
        self.sampling_state.update(scheduler_output)
        if scheduler_output.copies_before_step:
            copy_blocks(scheduler_output.copies_before_step, self._group_tensors, self._num_blocks)
        if scheduler_output.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        batch = build_input_batch(
            scheduled_req_ids(scheduler_output, states, self.config.reorder_batch_threshold),
            states,
            scheduler_output.num_scheduled_tokens,
            scheduler_output.scheduled_spec_tokens,
        )
        model_inputs: dict[str, torch.Tensor] = {}
        if self.images is not None:  # images: input embeddings, and key ends if both ways
            batch, model_inputs = self.images.prepare(batch, states)
        prompt_rows = prompt_logprob_rows(batch, states, self.device)
        step = StepRows(batch.logits_indices, self._full_reqs(batch))
        ctx = build_forward_context(
            self.attention_groups, batch, step, self.kv_caches, self.build_stats
        )
        copies_after = list(scheduler_output.copies_after_step)
        saves = saves_by_request(scheduler_output.state_saves)
        if self._mamba_groups:
            cuts, state_copies = checkpoint_cuts(batch, states, self._mamba_modes, saves)
            copies_after.extend(state_copies)
            per_group = build_mamba_metadata(
                batch, states, self._mamba_modes, self._mamba_kernels, cuts
            )
            layers = {name: per_group[gid] for name, gid in self._mamba_groups.items()}
            ctx = replace(ctx, mamba_metadata=layers)
        with self._lora_step(batch, scheduler_output.upcoming_loras):
            hidden = self._forward(batch, ctx, model_inputs, prompt_rows is not None)
        if self.proposer is not None:
            self.proposer.observe(batch, ctx, hidden, saves)
        if copies_after:
            copy_blocks(copies_after, self._group_tensors, self._num_blocks)
        rows = batch.logits_indices
        if prompt_rows is not None:
            rows = torch.cat([rows, prompt_rows.rows])
        logits = self.model.compute_logits(hidden[rows])  # [num_rows, vocab] fp32
        if not self.is_driver:
            self._follow_driver(batch, scheduler_output)
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        num_sampled = len(batch.logits_indices)
        output = self._sample(batch, logits[:num_sampled], scheduler_output)
        if prompt_rows is None:
            return output
        return replace(output, prompt_logprobs=prompt_logprobs(logits[num_sampled:], prompt_rows))

    def _forward(
        self, batch: InputBatch, ctx: ForwardContext, inputs: dict[str, torch.Tensor], extra: bool
    ) -> torch.Tensor:
        """A uniform decode step from the static buffers (a CUDA graph's replay), any other step
        eagerly (`inputs`: image embeddings; `extra`: prompt-logprob rows)."""
        plan = None if self.graphs is None else self.graphs.plan(batch, ctx, bool(inputs) or extra)
        if plan is None or self.graphs is None:
            return self.model(batch.input_ids, batch.positions, ctx, **inputs)
        return self.graphs.run(plan, batch, ctx)

    def _lora_step(
        self, batch: InputBatch, upcoming: Sequence[LoRARequest]
    ) -> contextlib.AbstractContextManager[None]:
        """Applies the batch's adapters to the forward inside it, and starts copying the
        `upcoming` ones into free slots beside it (nothing when LoRA is off)."""
        if self.lora is None:
            return contextlib.nullcontext()
        states = self._require_states()
        loras = [states.requests[req_id].lora_request for req_id in batch.req_ids]
        num_tokens = np.diff(batch.query_start_loc_np).tolist()
        held = [req.lora_request for req in states.requests.values()]
        segments = self.lora.segments_for(loras, num_tokens, held)
        self.lora.prefetch(upcoming)  # after segments_for: the step's slots are held
        return self.lora.active(segments)

    @property
    def block_tensors(self) -> tuple[GroupTensors, int]:
        """Every cache tensor of each KV cache group, and the pool's block count (transfers)."""
        return self._group_tensors, self._num_blocks

    def _require_offload(self) -> HostOffloadStore:
        if self.offload is None:
            raise RuntimeError("initialize_kv_cache must be called before execute")
        return self.offload

    def _require_states(self) -> RequestStates:
        if self.states is None:
            raise RuntimeError("initialize_kv_cache must be called before execute")
        return self.states

    def _sample(
        self, batch: InputBatch, logits: torch.Tensor, scheduler_output: SchedulerOutput
    ) -> ModelRunnerOutput:
        """Sample every request that reaches its last known token: one token, or (with drafts)
        the accepted drafts and the token after them; then propose the next drafts."""
        states = self._require_states()
        sampled = [states.requests[batch.req_ids[idx]] for idx in batch.sampled_req_idx]
        sampled_ids: list[list[int]] = [[] for _ in batch.req_ids]
        if not sampled:
            return ModelRunnerOutput(req_ids=batch.req_ids, sampled_token_ids=sampled_ids)
        spec = scheduler_output.scheduled_spec_tokens
        drafts = [spec.get(req.req_id, []) for req in sampled]
        tokens, entries = self._sample_rows(logits, sampled, drafts, scheduler_output)
        logprobs: dict[str, list[TokenLogprobs]] = {}
        keep_sampled = scheduler_output.workers_append_sampled
        if keep_sampled or self._drafts_on_every_rank:
            self._share_samples(sampled, tokens, keep_sampled)
        for idx, req, emitted, entry in zip(
            batch.sampled_req_idx, sampled, tokens, entries, strict=True
        ):
            sampled_ids[idx] = emitted
            if entry is not None:
                logprobs[req.req_id] = entry
        return ModelRunnerOutput(
            req_ids=batch.req_ids,
            sampled_token_ids=sampled_ids,
            logprobs=logprobs or None,
            draft_token_ids=self._propose(sampled, tokens, keep_sampled),
        )

    @property
    def _drafts_on_every_rank(self) -> bool:
        """A drafter model sharded over several ranks: each runs the draft steps."""
        return self.proposer is not None and self.proposer.runs_on_every_rank

    def _share_samples(
        self, sampled: list[CachedRequestState], tokens: list[list[int]] | None, append: bool
    ) -> list[list[int]]:
        """The step's sampled tokens, rank 0's on every rank (the others pass None); `append`:
        add them to the requests' tokens (async scheduling: the next step may compute them)."""
        shared = broadcast_token_lists(tokens, len(sampled), self.device)
        if append:
            for req, emitted in zip(sampled, shared, strict=True):
                req.token_ids.extend(emitted)
        return shared

    def _sample_rows(
        self,
        logits: torch.Tensor,
        sampled: list[CachedRequestState],
        drafts: list[list[int]],
        scheduler_output: SchedulerOutput,
    ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
        """Tokens and logprobs per sampling request; `logits` has 1 + len(drafts) rows each."""
        verified = [i for i, request_drafts in enumerate(drafts) if request_drafts]
        if not verified:
            return self._sample_last_rows(logits, sampled, scheduler_output)
        layout = RowLayout.from_drafts(drafts)
        plain = [i for i, request_drafts in enumerate(drafts) if not request_drafts]
        tokens: list[list[int]] = [[] for _ in sampled]
        entries: list[list[TokenLogprobs] | None] = [None] * len(sampled)
        if plain:
            rows = torch.tensor(layout.last_rows(plain), device=logits.device)
            plain_reqs = [sampled[i] for i in plain]
            plain_out = self._sample_last_rows(logits[rows], plain_reqs, scheduler_output)
            for i, emitted, entry in zip(plain, *plain_out, strict=True):
                tokens[i], entries[i] = emitted, entry
        expanded = [sampled[i] for i in verified for _ in range(1 + len(drafts[i]))]
        rows = torch.tensor(layout.all_rows(verified), device=logits.device)
        tensors = self.sampling_state.build(expanded, logits.shape[-1])
        grammar = GrammarMask.build(
            scheduler_output.grammar_bitmask, [req.req_id for req in expanded], self.device
        )
        if grammar is not None:
            tensors = replace(tensors, grammar=grammar)
        result = verify_drafts(
            logits[rows], [drafts[i] for i in verified], tensors, self.sampler.generator
        )
        for i, emitted, entry in zip(verified, result.token_ids, result.logprobs, strict=True):
            tokens[i], entries[i] = emitted, entry
        return tokens, entries

    def _sample_last_rows(
        self,
        logits: torch.Tensor,
        sampled: list[CachedRequestState],
        scheduler_output: SchedulerOutput,
    ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
        """One token per request from its row of `logits` (the usual sampler)."""
        tensors = self.sampling_state.build(sampled, logits.shape[-1])
        grammar = GrammarMask.build(
            scheduler_output.grammar_bitmask, [req.req_id for req in sampled], self.device
        )
        if grammar is not None:
            tensors = replace(tensors, grammar=grammar)
        out = self.sampler.sample(logits, tensors)
        entries = [None if entry is None else [entry] for entry in out.logprobs]
        return [[token] for token in out.token_ids.tolist()], entries

    def _follow_driver(self, batch: InputBatch, scheduler_output: SchedulerOutput) -> None:
        """On a rank other than the driver: take the driver's sampled tokens when the next step
        may compute them already (async scheduling), and run a sharded drafter model's steps
        with the driver's."""
        append = scheduler_output.workers_append_sampled
        states = self._require_states()
        sampled = [states.requests[batch.req_ids[i]] for i in batch.sampled_req_idx]
        if not sampled or not (append or self._drafts_on_every_rank):
            return
        tokens = self._share_samples(sampled, None, append)
        if self._drafts_on_every_rank:
            self._propose(sampled, tokens, append)

    def _propose(
        self, sampled: list[CachedRequestState], tokens: list[list[int]], appended: bool
    ) -> dict[str, list[int]] | None:
        """Drafts for the next step of the requests that may speculate (None: none), from the
        `tokens` they emitted this step (`appended`: already in their token ids)."""
        if self.proposer is None:
            return None
        return run_proposer(self.proposer, sampled, tokens, appended) or None

    def _full_reqs(self, batch: InputBatch) -> torch.Tensor | None:
        """Batch indices of requests whose every row must be computed (prompt logprobs)."""
        states = self._require_states()
        wanted = [
            idx
            for idx, req_id in enumerate(batch.req_ids)
            if states.requests[req_id].sampling_params.prompt_logprobs is not None
        ]
        return torch.tensor(wanted, dtype=torch.int64, device=self.device) if wanted else None
