"""A script written for vLLM's offline API runs with only its import line changed.

The script uses what vLLM users reach for first: string prompts, prompt dicts, `n`, `stop`,
`logprobs`, `chat`; its outputs are checked against transformers on the same weights (the
embedded default model) and against vLLM's documented output shapes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

SCRIPT = """
from vllm import LLM, SamplingParams

llm = LLM(max_model_len=256, dtype="float32")
greedy = SamplingParams(temperature=0, max_tokens=12, logprobs=3)
outputs = llm.generate(
    ["The capital of France is", {"prompt": "Hello, my name is"}], greedy
)
samples = llm.generate(
    {"prompt_token_ids": [504, 3575, 282, 4649, 314]},
    SamplingParams(n=3, temperature=0.8, seed=0, max_tokens=10),
)
stopped = llm.generate(
    "The capital of France is", SamplingParams(temperature=0, max_tokens=12, stop=["."])
)
chat = llm.chat(
    [{"role": "user", "content": "Name a primary colour."}],
    SamplingParams(temperature=0, max_tokens=32),
)
for output in outputs + samples + stopped + chat:
    for completion in output.outputs:
        print(output.request_id, completion.index, repr(completion.text), completion.finish_reason)
"""


def test_a_vllm_script_runs_unchanged_but_for_the_import(
    default_model_dir: Path, gguf_reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    import worker.default_model

    monkeypatch.setattr(worker.default_model, "DEFAULT_CACHE_DIR", default_model_dir)
    source = SCRIPT.replace("from vllm import", "from cluster import")
    assert source.count("\n") == SCRIPT.count("\n")
    namespace: dict[str, object] = {}
    exec(compile(source, "vllm_script.py", "exec"), namespace)
    namespace["llm"].shutdown()  # type: ignore[attr-defined]

    tokenizer, hf_model = gguf_reference
    outputs = namespace["outputs"]
    for output in outputs:  # type: ignore[attr-defined]
        ids = tokenizer(output.prompt).input_ids
        assert output.prompt_token_ids == ids
        with torch.no_grad():
            expected = hf_model.generate(
                torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None
            )[0, len(ids) :].tolist()
        completion = output.outputs[0]
        assert completion.token_ids == expected
        assert completion.text == tokenizer.decode(expected, skip_special_tokens=True)
        assert len(completion.logprobs) == 12
        assert all(next(iter(lp)) == t for lp, t in zip(completion.logprobs, expected, strict=True))
        assert all(len(lp) in (3, 4) for lp in completion.logprobs)
    (samples,) = namespace["samples"]  # type: ignore[misc]
    assert [c.index for c in samples.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in samples.outputs}) == 3
    (stopped,) = namespace["stopped"]  # type: ignore[misc]
    completion = stopped.outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == "."
    assert completion.text == outputs[0].outputs[0].text.split(".")[0]  # type: ignore[index]
    (chat,) = namespace["chat"]  # type: ignore[misc]
    assert chat.prompt.endswith("<|im_start|>assistant\n")
    assert "Red" in chat.outputs[0].text
