"""The code blocks of the README and the docs pages, so tests run exactly what they tell users to
run.

The README keeps one short example per feature and links a page under `docs/` for the rest;
`code_block` reads the page a test names, or, when it names none, the README first and then the
docs pages in name order.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers.ray_local import REPO_ROOT

_BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.DOTALL)

README = "README.md"


def documentation_pages() -> list[str]:
    """The README and every docs page, as paths relative to the repository root."""
    docs = sorted(path.relative_to(REPO_ROOT) for path in (REPO_ROOT / "docs").glob("*.md"))
    return [README, *(str(path) for path in docs)]


def code_block(containing: str, language: str, page: str | None = None) -> str:
    """The first `language` block whose text contains `containing`, in `page` (a path relative
    to the repository root) or, without one, in the README and then the docs pages."""
    pages = [page] if page is not None else documentation_pages()
    for name in pages:
        for lang, body in _BLOCK.findall(Path(REPO_ROOT / name).read_text()):
            if lang == language and containing in body:
                return str(body)
    raise AssertionError(f"{' / '.join(pages)}: no {language} block containing {containing!r}")
