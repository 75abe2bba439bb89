"""The README and the docs pages hold together: every engine argument is in the configuration
reference and in the README's configuration table, every docs page is reachable from the README,
every link between them names a file and a heading that exist, and the README's one-line feature
examples are commands and configs the product accepts."""

from __future__ import annotations

import re
import shlex

import pytest
import yaml

from cluster.config.engine_args import EngineArgs
from tests.helpers.ray_local import REPO_ROOT
from tests.helpers.readme import README, code_block, documentation_pages

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"```.*?```", re.DOTALL)


def _text(page: str) -> str:
    return (REPO_ROOT / page).read_text()


def _section(page: str, heading: str) -> str:
    """The text under `heading` (a `## ` line) up to the next `## ` heading."""
    text = _text(page)
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: str) -> set[str]:
    headings = re.findall(r"^#+ (.+)$", _CODE.sub("", _text(page)), re.MULTILINE)
    return {_anchor(heading) for heading in headings}


def _links(page: str) -> list[str]:
    """The page's relative links (web addresses left out), outside code blocks."""
    links = _LINK.findall(_CODE.sub("", _text(page)))
    return [link for link in links if not re.match(r"[a-z]+://", link)]


@pytest.mark.parametrize("page", ["docs/configuration.md", README])
def test_every_engine_argument_is_in_the_configuration_tables(page: str) -> None:
    table = _section(page, "Engine arguments" if page != README else "Configuration")
    missing = [name for name in EngineArgs.model_fields if f"`{name}`" not in table]
    assert not missing, f"{page} does not document {missing}"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {link.split("#")[0] for link in _links(README)}
    unlinked = [page for page in documentation_pages()[1:] if page not in linked]
    assert not unlinked, f"README.md links no {unlinked}"


@pytest.mark.parametrize("page", documentation_pages())
def test_every_link_names_a_file_and_heading_that_exist(page: str) -> None:
    broken = []
    for link in _links(page):
        path, _, anchor = link.partition("#")
        target = (REPO_ROOT / page).parent / path if path else REPO_ROOT / page
        if not target.exists():
            broken.append(link)
        elif anchor and target.suffix == ".md":
            relative = str(target.resolve().relative_to(REPO_ROOT))
            if anchor not in _anchors(relative):
                broken.append(link)
    assert not broken, f"{page}: broken links {broken}"


def _readme_serve_commands() -> list[str]:
    """The `hybridserve serve` lines of the README's shell blocks, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", _text(README), re.DOTALL)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if re.match(r"(\.venv/bin/)?hybridserve serve\b", line)]


def test_the_readme_serve_commands_parse_into_valid_engine_arguments() -> None:
    """Each feature's one-line `hybridserve serve` example is a command the CLI accepts, with
    engine arguments `EngineArgs` accepts, and sets what its feature needs."""
    from cluster.cli.main import build_parser
    from cluster.config.engine_args import validate_engine_kwargs
    from cluster.config.engine_flags import engine_kwargs_from_args

    commands = _readme_serve_commands()
    engines = []
    for command in commands:
        args = build_parser().parse_args(shlex.split(command)[1:])
        engines.append(validate_engine_kwargs(engine_kwargs_from_args(args)))
    assert any(engine.speculative_config for engine in engines), commands
    assert any(engine.enable_lora for engine in engines), commands
    assert any(engine.kv_offloading_size for engine in engines), commands


def test_the_readme_pd_config_is_valid_serving_args() -> None:
    from cluster.config.pd_args import PDServingArgs

    block = yaml.safe_load(code_block("prefill_config:", "yaml", README))
    args = PDServingArgs.model_validate(block)
    assert args.kv_transfer_timeout_s == 30
