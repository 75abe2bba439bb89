"""A small multiple-choice task for lm-evaluation-harness, from a local JSON file (no download),
run with its `local-completions` model against a served model, and the per-choice
loglikelihoods computed offline with transformers for comparison.

The served tiny model uses the word-level tokenizer (`t0` .. `t255`), so a question and its
choices are words of that vocabulary; the harness joins them with a space.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

TASK = "hybridserve_tiny_choice"
QUESTIONS = [
    {"question": "t5 t17 t33", "choices": ["t2", "t9 t40", "t41"], "answer": 1},
    {"question": "t100 t3 t4 t5", "choices": ["t6", "t7", "t8 t9"], "answer": 0},
    {"question": "t7 t7 t8", "choices": ["t9", "t10 t11", "t12", "t13"], "answer": 2},
    {"question": "t50 t60", "choices": ["t70", "t80"], "answer": 1},
]


def write_task(folder: Path) -> Path:
    """The task's YAML and data under `folder`; returns the folder (the harness's include path)."""
    data = folder / "questions.json"
    data.write_text(json.dumps(QUESTIONS))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    return folder


def harness_environment(task_dir: Path, api_key: str) -> dict[str, str]:
    """The environment the harness reads: the bearer token it sends, datasets offline."""
    return {
        "OPENAI_API_KEY": api_key,
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(task_dir / "datasets-cache"),
    }


def run_harness(base_url: str, model_dir: Path, task_dir: Path) -> dict[str, Any]:
    """lm-evaluation-harness's `local-completions` on the task (with `harness_environment`
    set): its results with samples."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    model_args = (
        f"model=tiny,base_url={base_url}/v1/completions,tokenizer={model_dir},"
        "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1"
    )
    results: dict[str, Any] = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(task_dir)),
        log_samples=True,
    )
    return results


def offline_loglikelihoods(model_dir: Path) -> list[list[float]]:
    """Per question, each choice's loglikelihood given the question (transformers, fp32)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    scores = []
    for doc in QUESTIONS:
        context = tokenizer(doc["question"]).input_ids
        per_choice = []
        for choice in doc["choices"]:
            continuation = tokenizer(choice).input_ids
            ids = torch.tensor([context + continuation])
            with torch.no_grad():
                logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            rows = range(len(context) - 1, len(context) + len(continuation) - 1)
            per_choice.append(sum(float(logprobs[row, ids[0, row + 1]]) for row in rows))
        scores.append(per_choice)
    return scores
