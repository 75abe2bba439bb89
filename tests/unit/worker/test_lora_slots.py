"""Adapter files, checks and slots on the worker (tiny Llama and gpt-oss, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from scheduler.lora import LoRAConfig, LoRARequest
from tests.helpers.tiny_gemma4_gpt_oss import GPT_OSS, save_gemma4_or_gpt_oss
from tests.helpers.tiny_lora import save_random_adapter
from tests.helpers.tiny_models import load_our_model, save_tiny_model
from worker.lora.manager import LoRAManager
from worker.lora.peft_files import CONFIG_FILE, WEIGHTS_FILE


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora")
    hf_model = save_tiny_model("llama", root / "base", num_hidden_layers=2)
    save_random_adapter(hf_model, root / "r4", rank=4, seed=1)
    save_random_adapter(hf_model, root / "r8", rank=8, seed=2)
    save_random_adapter(hf_model, root / "q_only", ["q_proj"], rank=4, seed=3)
    return root


def _manager(saved: Path, **config: int | bool) -> LoRAManager:
    model = load_our_model(saved / "base")
    return LoRAManager(model, LoRAConfig(**config), torch.device("cpu"))


def _copy_adapter(source: Path, target: Path) -> Path:
    target.mkdir()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        (target / name).write_bytes((source / name).read_bytes())
    return target


def test_missing_malformed_and_too_large_adapters_are_errors_naming_them(
    saved: Path, tmp_path: Path
) -> None:
    manager = _manager(saved, max_lora_rank=4)
    with pytest.raises(ValueError, match=r"'gone'.*does not exist"):
        manager.add_adapter(LoRARequest("gone", 1, str(tmp_path / "nowhere")))
    broken = _copy_adapter(saved / "r4", tmp_path / "broken")
    (broken / CONFIG_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=r"'broken'.*not valid JSON"):
        manager.add_adapter(LoRARequest("broken", 1, str(broken)))
    with pytest.raises(ValueError, match=r"'big' has rank 8, above max_lora_rank=4"):
        manager.add_adapter(LoRARequest("big", 1, str(saved / "r8")))
    dora = _copy_adapter(saved / "r4", tmp_path / "dora")
    config = json.loads((dora / CONFIG_FILE).read_text())
    (dora / CONFIG_FILE).write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match=r"'dora': use_dora"):
        manager.add_adapter(LoRARequest("dora", 1, str(dora)))
    assert not manager.host  # nothing half-loaded


def test_adapter_targeting_a_module_the_model_lacks_is_an_error(
    saved: Path, tmp_path: Path
) -> None:
    other = _copy_adapter(saved / "r4", tmp_path / "other")
    tensors = load_file(str(other / WEIGHTS_FILE))
    renamed = {key.replace("layers.1.", "layers.7."): value for key, value in tensors.items()}
    save_file(renamed, str(other / WEIGHTS_FILE))
    with pytest.raises(ValueError, match=r"'other' targets module 'model\.layers\.7\."):
        _manager(saved).add_adapter(LoRARequest("other", 1, str(other)))


def test_device_slots_are_least_recently_used_and_never_exceeded(saved: Path) -> None:
    manager = _manager(saved, max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    one, two, three = (
        LoRARequest(name, 1, str(saved / folder))
        for name, folder in (("one", "r4"), ("two", "r8"), ("three", "q_only"))
    )
    manager.segments_for([one, None, two], [2, 1, 3])
    assert dict(manager.slots) == {"one": 0, "two": 1}
    segments = manager.segments_for([two, three], [1, 1])
    assert segments is not None
    assert dict(manager.slots) == {"two": 1, "three": 0}  # "one" was the least recently used
    assert list(manager.host) == ["two", "three"]  # the host cache holds max_cpu_loras
    layer = manager.layers["model.layers.0.mlp.down_proj"]
    assert not layer.lora_a[0].any()  # slot 0 no longer holds "one"'s down_proj
    with pytest.raises(RuntimeError, match="more than max_loras=2"):
        manager.segments_for([one, two, three], [1, 1, 1])


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny gpt-oss and a rank-8 adapter on its stacked experts (PEFT's target_parameters)."""
    root = tmp_path_factory.mktemp("lora_moe")
    hf_model = save_gemma4_or_gpt_oss("GptOssConfig", "GptOssForCausalLM", GPT_OSS, root / "base")
    experts = ["experts.gate_up_proj", "experts.down_proj"]
    save_random_adapter(hf_model, root / "experts", [], rank=8, target_parameters=experts)
    return root


def test_expert_adapters_too_large_or_for_missing_parameters_are_errors(
    gpt_oss: Path, tmp_path: Path
) -> None:
    model = load_our_model(gpt_oss / "base")
    manager = LoRAManager(model, LoRAConfig(max_lora_rank=4), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"'big' has rank 8, above max_lora_rank=4"):
        manager.add_adapter(LoRARequest("big", 1, str(gpt_oss / "experts")))
    other = _copy_adapter(gpt_oss / "experts", tmp_path / "other")
    config = json.loads((other / CONFIG_FILE).read_text())
    config["target_parameters"] = ["experts.gate_proj", "experts.up_proj"]
    (other / CONFIG_FILE).write_text(json.dumps(config))
    manager = LoRAManager(model, LoRAConfig(max_lora_rank=8), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"'other' targets expert parameters \['experts\.gate_pr"):
        manager.add_adapter(LoRARequest("other", 1, str(other)))
    manager.add_adapter(LoRARequest("experts", 1, str(gpt_oss / "experts")))
    assert sorted(manager.host["experts"])[:2] == [
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.0.mlp.experts.gate_up_proj",
    ]


def _requests(saved: Path) -> tuple[LoRARequest, LoRARequest, LoRARequest]:
    one, two, three = (
        LoRARequest(name, 1, str(saved / folder))
        for name, folder in (("one", "r4"), ("two", "r8"), ("three", "q_only"))
    )
    return one, two, three


def test_adapter_added_between_steps_is_in_its_slot_before_the_step(saved: Path) -> None:
    manager = _manager(saved, max_loras=2, max_lora_rank=8)
    one, two, _ = _requests(saved)
    with torch.inference_mode():  # as in a step: its slots are inference tensors
        manager.segments_for([two], [1])  # a step that has to copy "two" itself
    assert manager.num_step_loads == 1
    manager.add_adapter(one)  # the engine adds it when a request names it
    assert manager.slots["one"] == 1
    segments = manager.segments_for([one, two], [2, 1])
    assert segments is not None
    assert manager.num_step_loads == 1  # "one" was copied off the step
    layer = manager.layers["model.layers.0.mlp.down_proj"]
    weights = manager.host["one"]["model.layers.0.mlp.down_proj"][None]
    torch.testing.assert_close(layer.lora_a[1, :4], weights.a)


def test_slot_of_an_adapter_a_held_request_uses_is_never_taken(saved: Path) -> None:
    manager = _manager(saved, max_loras=2, max_lora_rank=8, max_cpu_loras=3)
    one, two, three = _requests(saved)
    manager.segments_for([one, two], [1, 1])
    layer = manager.layers["model.layers.0.self_attn.qkv_proj"]
    held_a = layer.lora_a[:2].clone()
    manager.add_adapter(three)  # both slots are held by running requests: no copy now
    assert dict(manager.slots) == {"one": 0, "two": 1}
    assert torch.equal(layer.lora_a[:2], held_a)
    manager.segments_for([two], [1], held=[two])  # the request using "one" finished
    manager.add_adapter(three)
    assert dict(manager.slots) == {"two": 1, "three": 0}
    manager.segments_for([three, two], [1, 1])
    assert manager.num_step_loads == 2  # the first step's two adapters only
    assert torch.equal(layer.lora_a[1], held_a[1])


@pytest.mark.parametrize("prefetch", [True, False])
def test_adapter_evicted_then_named_by_a_waiting_request_is_copied_before_its_step(
    saved: Path, prefetch: bool
) -> None:
    manager = _manager(saved, max_loras=2, max_lora_rank=8, max_cpu_loras=3, prefetch=prefetch)
    one, two, three = _requests(saved)
    with torch.inference_mode():  # as in a step: its slots are inference tensors
        manager.segments_for([one, two], [1, 1])
        manager.segments_for([two, three], [1, 1])  # "three" takes "one"'s slot in the step
    assert (dict(manager.slots), manager.num_step_loads) == ({"two": 1, "three": 0}, 3)
    layer = manager.layers["model.layers.0.self_attn.qkv_proj"]
    held_a = layer.lora_a.clone()
    manager.prefetch([one])  # both slots are held by running requests: no copy now
    assert dict(manager.slots) == {"two": 1, "three": 0}
    manager.prefetch([LoRARequest("unread", 1, str(saved / "r4"))])  # no host copy: skipped
    assert torch.equal(layer.lora_a, held_a)
    manager.segments_for([two], [1], held=[two])  # the requests using "three" finished
    manager.prefetch([one])  # a waiting request names "one" again
    segments = manager.segments_for([one, two], [1, 1])
    assert segments is not None
    assert manager.num_step_loads == (3 if prefetch else 4)
    assert manager.num_copies_ahead == (1 if prefetch else 0)
    assert torch.equal(layer.lora_a[1], held_a[1])  # "two"'s slot was never touched
    weights = manager.host["one"]["model.layers.0.mlp.down_proj"][None]
    torch.testing.assert_close(
        manager.layers["model.layers.0.mlp.down_proj"].lora_a[0, :4], weights.a
    )


def test_step_takes_the_slot_of_a_copy_ahead_whose_request_did_not_come(saved: Path) -> None:
    manager = _manager(saved, max_loras=1, max_lora_rank=8, max_cpu_loras=3)
    one, two, three = _requests(saved)
    with torch.inference_mode():  # as in a step: its slots are inference tensors
        manager.segments_for([one], [1])
    manager.add_adapter(two)  # "one" holds the slot: host copy only
    manager.segments_for([None], [1])  # the request using "one" finished
    manager.prefetch([two])  # the next waiting request names "two", then is aborted
    assert manager.loads.is_pending("two")
    manager.segments_for([three], [1])  # a request with another adapter runs first
    assert (dict(manager.slots), manager.num_step_loads) == ({"three": 0}, 2)
    assert not manager.layers["model.layers.0.mlp.down_proj"].lora_a[0].any()  # q_proj only
