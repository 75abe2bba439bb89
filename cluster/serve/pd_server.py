"""The two sides of a prefill/decode-disaggregated model, each an `LLMServer` replica.

    ingress ─► PDDecodeServer.generate ─► before_add: held keys ─► PDPrefillServer
                                                   prefill_and_export (prompt[:-1], 1 token)
               import the KV (object store or direct) ◄┘
               engine.add_request (hits the prefix: computes the last token, decodes)

The decode side keeps prefix caching on: it sends the keys it holds, and receives only the rest.
A prefill side that fails, dies or misses the deadline costs a recompute on the decode side,
never the request.
"""

from __future__ import annotations

import uuid
from typing import Any

from cluster.config import LLMConfig
from cluster.engine.kv_transfer import KVTransfer, kv_export
from cluster.engine.request import EngineRequest
from cluster.serve.llm_server import LLMServer
from cluster.serve.peer_pull import import_prefix
from scheduler.kv_cache.transfer import HeldKeys
from scheduler.request import SamplingParams

_PREFILL_PARAMS = SamplingParams(temperature=0, max_tokens=1)


class PDPrefillServer(LLMServer):
    """The prefill side: computes a prompt's prefix and exports its KV."""

    async def prefill_and_export(
        self,
        prompt_token_ids: list[int],
        held: HeldKeys,
        cache_salt: str | None,
        timeout_s: float,
    ) -> KVTransfer:
        """Compute every prompt token but the last (its blocks stay cached), then export the
        blocks of the prefix the decode side does not hold (pages offered over a direct
        connection wait `timeout_s` for it)."""
        if len(prompt_token_ids) > 1:
            request = EngineRequest(
                request_id=f"prefill-{uuid.uuid4().hex}",
                prompt_token_ids=tuple(prompt_token_ids[:-1]),
                sampling_params=_PREFILL_PARAMS,
                cache_salt=cache_salt,
            )
            async for _ in await self.engine.add_request(request):
                pass
        return await self.engine.call_core(
            kv_export, prompt_token_ids, held, cache_salt, False, timeout_s
        )


class PDDecodeServer(LLMServer):
    """The decode side: imports the prefill side's KV before a request enters its engine."""

    def __init__(
        self, llm_config: LLMConfig | dict[str, Any], prefill: Any, transfer_timeout_s: float
    ) -> None:
        super().__init__(llm_config)
        self.prefill = prefill
        self.transfer_timeout_s = transfer_timeout_s

    async def before_add(self, request: EngineRequest) -> None:
        """Import the prefix's KV from the prefill side (counted as a pull; on failure, as a
        recompute)."""
        label = f"prefill hand-off of {request.request_id}"
        await import_prefix(
            self.engine,
            request,
            self.prefill.prefill_and_export.remote,
            self.transfer_timeout_s,
            label,
        )
