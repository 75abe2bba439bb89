"""The xdist grouping names every test module built on the embedded default model (and only
those), so that model is converted and read on one worker."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers.xdist_groups import DEFAULT_MODEL_MODULES, group_of

REPO_ROOT = Path(__file__).resolve().parents[2]
USES_DEFAULT_MODEL = re.compile(r"\b(default_model_dir|gguf_reference|default_gguf_path)\b")


def _modules_on_the_default_model() -> set[str]:
    return {
        str(path.relative_to(REPO_ROOT))
        for path in (REPO_ROOT / "tests").rglob("test_*.py")
        if USES_DEFAULT_MODEL.search(path.read_text())
    }


def test_every_module_on_the_default_model_shares_its_group() -> None:
    on_default_model = _modules_on_the_default_model() - {"tests/unit/test_xdist_groups.py"}
    assert on_default_model == DEFAULT_MODEL_MODULES
    assert group_of("tests/unit/cluster/test_detokenizer.py::test_x") == "default-model"
    assert group_of("tests/unit/test_messages.py::test_x") == "tests/unit/test_messages.py"
