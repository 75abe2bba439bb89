"""Generated gRPC modules of `llm.proto` (regenerate with `make grpc`; not linted)."""
