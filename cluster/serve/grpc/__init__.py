"""The gRPC side of the Serve app: the ingress's methods (`methods.py`) and the modules generated
from `llm.proto` (regenerate with `make grpc`; not linted)."""
