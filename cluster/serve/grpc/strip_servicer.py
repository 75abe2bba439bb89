"""Drop the unused servicer base class from the generated `llm_pb2_grpc.py`.

grpcio-tools writes an `LLMServiceServicer` base whose methods answer UNIMPLEMENTED; the RPCs are
served by the ingress deployment's methods through Ray Serve's gRPC proxy, so the shipped module
keeps only the stub and `add_LLMServiceServicer_to_server`. Run by `make grpc` after protoc.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def strip(path: Path) -> None:
    text = path.read_text()
    stripped = re.sub(r"\nclass LLMServiceServicer:.*?(?=\n\ndef )", "\n", text, flags=re.S)
    path.write_text(stripped)


if __name__ == "__main__":
    strip(Path(sys.argv[1]))
