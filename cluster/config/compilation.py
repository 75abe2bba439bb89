"""`compilation_config` as users write it (vLLM's keys), checked and turned into the frozen
`worker.graphs.capture_sizes.CudaGraphConfig` the workers read (with `enforce_eager`)."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field

from cluster.config.base import StrictModel
from worker.graphs.capture_sizes import CudaGraphConfig, CudaGraphMode

CaptureSize = Annotated[int, Field(ge=1)]
CudaGraphModeName = Literal["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]


class CompilationConfigArgs(StrictModel):
    """How decode steps are captured as CUDA graphs (on CUDA; CPU steps always run eagerly)."""

    model_config = ConfigDict(use_attribute_docstrings=True)
    key_name: ClassVar[str] = "compilation_config key"

    cudagraph_mode: CudaGraphModeName = "FULL_AND_PIECEWISE"
    """vLLM's modes: NONE (no graphs) | FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE (decode and
    speculative-verify steps as full graphs of the whole forward; mixed prefill steps run
    eagerly) | PIECEWISE (no piecewise graphs yet: every step runs eagerly)."""
    cudagraph_capture_sizes: list[CaptureSize] | None = None
    """Batch sizes in tokens captured as graphs; default vLLM's 1, 2, 4, 8, 16, ... up to
    `max_cudagraph_capture_size`. A step is padded to the smallest size holding it."""
    max_cudagraph_capture_size: int | None = Field(None, ge=1)
    """Largest captured batch in tokens; default min(2 x max_num_seqs x rows per request, 512)."""

    def to_config(self, enforce_eager: bool) -> CudaGraphConfig:
        sizes = self.cudagraph_capture_sizes
        return CudaGraphConfig(
            mode=CudaGraphMode(self.cudagraph_mode),
            capture_sizes=None if sizes is None else tuple(sorted(set(sizes))),
            max_capture_size=self.max_cudagraph_capture_size,
            enforce_eager=enforce_eager,
        )


def parse_compilation_config(value: Any) -> Any:
    """A JSON object given as text (`--compilation-config '{"cudagraph_mode": "NONE"}'`)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"compilation_config is not valid JSON: {error}") from None
    return value
