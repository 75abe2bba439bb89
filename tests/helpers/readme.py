"""The README's code blocks, so tests run exactly what the README tells users to run."""

from __future__ import annotations

import re

from tests.helpers.ray_local import REPO_ROOT

_BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.DOTALL)


def code_block(containing: str, language: str) -> str:
    """The README's first `language` block whose text contains `containing`."""
    text = (REPO_ROOT / "README.md").read_text()
    for lang, body in _BLOCK.findall(text):
        if lang == language and containing in body:
            return str(body)
    raise AssertionError(f"README.md has no {language} block containing {containing!r}")
