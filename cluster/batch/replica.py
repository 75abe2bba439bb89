"""`EngineReplica`: the Ray Data actor class that runs batches of rows through one engine.

Ray Data builds one instance per actor of the pool (`--replicas`); each instance owns one
in-process engine. A call gets a whole batch: every row's request is queued first, then the
streams are read, so the engine schedules the rows together (continuous batching). A row that
cannot run (its prompt too long, an empty prompt, no chat template) becomes an `error` row.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

from cluster.batch.rows import BatchItem, make_sampling_params, result_row
from cluster.engine.client import collect
from cluster.engine.outputs import RequestOutput
from cluster.engine.request import EngineRequest
from cluster.engine_args import EngineArgs
from cluster.llm_inputs import check_token_ids

logger = logging.getLogger(__name__)

Batch = dict[str, np.ndarray]


class EngineReplica:
    """One engine; `__call__` maps a batch of `BatchItem` records to output-row records."""

    def __init__(self, engine_args: EngineArgs) -> None:
        from cluster.engine.local import InProcessEngineClient

        self.client = InProcessEngineClient.from_engine_args(engine_args)
        self.info = self.client.get_info()
        self.tokenizer = self.client.get_tokenizer()

    def __call__(self, batch: Batch) -> Batch:
        items = [BatchItem.from_record(str(record)) for record in batch["item"]]
        rows: list[dict[str, Any] | None] = [None] * len(items)
        streams: list[tuple[int, int, Iterator[RequestOutput]]] = []
        for position, item in enumerate(items):
            try:
                request = self._engine_request(item)
                streams.append(
                    (position, len(request.prompt_token_ids), self.client.add_request(request))
                )
            except (TypeError, ValueError) as exc:
                rows[position] = item.error_row(str(exc))
        for position, prompt_len, stream in streams:
            rows[position] = self._read(items[position], prompt_len, stream)
        return {"row": np.array([json.dumps(row) for row in rows], dtype=object)}

    def _read(
        self, item: BatchItem, prompt_len: int, stream: Iterator[RequestOutput]
    ) -> dict[str, Any]:
        try:
            output = collect(stream)
        except Exception as exc:  # the engine failed on this request: report it, keep going
            logger.exception("row %s failed in the engine", item.row_id)
            return item.error_row(f"engine error: {exc}")
        completion = output.outputs[0]
        return result_row(
            item, prompt_len, list(completion.token_ids), completion.text, completion.finish_reason
        )

    def _engine_request(self, item: BatchItem) -> EngineRequest:
        if item.error is not None or item.request is None:
            raise ValueError(item.error or "no request")
        text, token_ids = self._prompt(item.request)
        return EngineRequest(
            request_id=f"batch-{item.index}",
            prompt_token_ids=tuple(check_token_ids(0, token_ids, self.info.vocab_size)),
            sampling_params=make_sampling_params(item.request),
            prompt=text,
        )

    def _prompt(self, request: dict[str, Any]) -> tuple[str | None, list[int]]:
        """(prompt text, token IDs) of a request: tokenized, chat-rendered or given as IDs."""
        if "prompt_token_ids" in request:
            ids = request["prompt_token_ids"]
            if not isinstance(ids, list):
                raise ValueError("prompt_token_ids must be a list of token IDs")
            return None, ids
        if "messages" in request:
            text = self._render_chat(request["messages"])
            return text, self._require_tokenizer("messages")(
                text, add_special_tokens=False
            ).input_ids
        prompt = request["prompt"]
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        return prompt, self._require_tokenizer("a text prompt")(prompt).input_ids

    def _render_chat(self, messages: object) -> str:
        tokenizer = self._require_tokenizer("messages")
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and {"role", "content"} <= m.keys() for m in messages
        ):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} objects")
        if not messages:
            raise ValueError("messages is empty")
        if not tokenizer.chat_template:
            raise ValueError(f"the tokenizer of {self.info.model_path} has no chat template")
        rendered = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return str(rendered)

    def _require_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise ValueError(
                f"{what} needs a tokenizer, but {self.info.model_path} has none; "
                "send prompt_token_ids"
            )
        return self.tokenizer

    def __del__(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.shutdown()
