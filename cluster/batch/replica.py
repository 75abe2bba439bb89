"""`EngineReplica`: the Ray Data actor class that runs batches of rows through one engine.

Ray Data builds one instance per actor of the pool (`--replicas`); each instance owns one
in-process engine. A call gets a whole batch: every row's request is queued first, then the
streams are read, so the engine schedules the rows together (continuous batching). A row that
cannot run (its prompt too long, an empty prompt, no chat template, a bad image) becomes an `error`
row. Prompts, images included, go through the engine's one input processor, as they do for `LLM`
and the Serve replica. With `output_format="openai"` an OpenAI input line comes back as OpenAI's
batch output line (`cluster.batch.openai_rows`), its body the one the Serve replica answers.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from cluster.batch.openai_rows import (
    Formatter,
    OutputFormat,
    answer_line,
    error_line,
    writes_openai_line,
)
from cluster.batch.rows import (
    BatchItem,
    lora_request,
    make_sampling_params,
    openai_request,
    prompt_logprobs_column,
    result_row,
    tool_call_column,
)
from cluster.config.engine_args import EngineArgs
from cluster.engine.client import collect
from cluster.engine.input_processor import InputProcessor, Prompt
from cluster.engine.mm_inputs import MultiModalConfig, load_multimodal_inputs
from cluster.engine.outputs import RequestOutput
from cluster.engine.request import EngineRequest
from cluster.serve.formatting import response_formatter

logger = logging.getLogger(__name__)

Batch = dict[str, np.ndarray]


class EngineReplica:
    """One engine; `__call__` maps a batch of `BatchItem` records to output-row records."""

    def __init__(self, engine_args: EngineArgs, output_format: OutputFormat = "columns") -> None:
        from cluster.engine.local import InProcessEngineClient

        self.output_format: OutputFormat = output_format

        self.client = InProcessEngineClient.from_engine_args(engine_args)
        self.info = self.client.get_info()
        self.model_name = Path(self.info.model_path).name
        """The `model` of a response body whose line names none."""
        self.tokenizer = self.client.get_tokenizer()
        multimodal = load_multimodal_inputs(
            self.info.model_path, MultiModalConfig.from_engine_args(engine_args)
        )
        self.inputs = InputProcessor(
            self.tokenizer,
            self.info.vocab_size,
            self.info.max_model_len,
            self.info.model_path,
            multimodal,
        )

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
                rows[position] = self._error_row(item, str(exc))
        for position, prompt_len, stream in streams:
            rows[position] = self._read(items[position], prompt_len, stream)
        return {"row": np.array([json.dumps(row) for row in rows], dtype=object)}

    def _error_row(self, item: BatchItem, message: str, status: int = 400) -> dict[str, Any]:
        if writes_openai_line(item, self.output_format):
            return error_line(item, message, status)
        return item.error_row(message)

    def _formatter(self, item: BatchItem, prompt_text: str | None) -> Formatter:
        """The body formatter of an OpenAI line (as the Serve replica makes it)."""
        assert item.request is not None
        request = openai_request(item.request["url"], item.request["body"])
        model = request.model or self.model_name
        return response_formatter(
            request, f"batch-{item.index}", model, prompt_text, self.tokenizer
        )

    def _read(
        self, item: BatchItem, prompt_len: int, stream: Iterator[RequestOutput]
    ) -> dict[str, Any]:
        try:
            output = collect(stream)
        except Exception as exc:  # the engine failed on this request: report it, keep going
            logger.exception("row %s failed in the engine", item.row_id)
            return self._error_row(item, f"engine error: {exc}", 500)
        if writes_openai_line(item, self.output_format):
            return answer_line(item, self._formatter(item, output.prompt), output)
        completion = output.outputs[0]
        row = result_row(
            item, prompt_len, list(completion.token_ids), completion.text, completion.finish_reason
        )
        calls = tool_call_column(item.request or {}, completion.text)
        if calls is not None:
            row["tool_calls"] = calls
        if output.prompt_logprobs is not None:
            row["prompt_logprobs"] = prompt_logprobs_column(output.prompt_logprobs)
        return row

    def _engine_request(self, item: BatchItem) -> EngineRequest:
        if item.error is not None or item.request is None:
            raise ValueError(item.error or "no request")
        request = item.request
        lora = None
        if "body" in request:
            prompt, params = self.inputs.openai(openai_request(request["url"], request["body"]))
        else:
            prompt, params = self._row_prompt(request), make_sampling_params(request)
            if request.get("lora_request") is not None:
                lora = lora_request(request["lora_request"])
        return EngineRequest(
            request_id=f"batch-{item.index}",
            prompt_token_ids=tuple(prompt.token_ids),
            sampling_params=params,
            prompt=prompt.text,
            lora_request=lora,
            mm_features=prompt.mm_features,
        )

    def _row_prompt(self, request: dict[str, Any]) -> Prompt:
        """A Ray Data LLM row's prompt: text, chat messages or token IDs."""
        if "messages" in request:
            return self.inputs.chat(request["messages"])
        if "prompt_token_ids" in request:
            return self.inputs.prompt(request["prompt_token_ids"])
        prompt = request["prompt"]
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        return self.inputs.prompt(prompt)

    def __del__(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.shutdown()
