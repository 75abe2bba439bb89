"""`collective_rpc` on one rank: a worker method by name, or a pickled function given the worker.

The engine sends the same `RpcCall` to every rank (vLLM's `collective_rpc`): a method name runs
`worker.method(*args, **kwargs)`; a function (pickled by value where it was written) runs as
`function(worker, *args, **kwargs)`. A name the worker lacks is a one-line ValueError.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RpcCall:
    """One call for every rank: `method` (a worker method's name) or `function` (the pickled
    bytes of a function taking the worker first), with its arguments."""

    method: str | None = None
    function: bytes | None = None
    args: tuple[object, ...] = ()
    kwargs: Mapping[str, object] = field(default_factory=dict)


def run_rpc(worker: object, call: RpcCall) -> object:
    """Run `call` on `worker`; its result (ValueError naming a method the worker lacks)."""
    if call.function is not None:
        function = pickle.loads(call.function)
        return function(worker, *call.args, **call.kwargs)
    name = call.method or ""
    target = None if name.startswith("_") else getattr(worker, name, None)
    if not callable(target):
        raise ValueError(f"collective_rpc: the worker has no method {name!r}")
    return target(*call.args, **call.kwargs)
