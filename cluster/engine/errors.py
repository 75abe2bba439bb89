"""The error every engine front raises when the engine cannot run a request any more.

The in-process client, the asyncio engine, the Ray engine client and the Serve replica all
raise (or, for Serve, answer 503 with) this one type, so callers handle one error whichever way
they reach the engine.
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine could not run the request: a step failed under it (the workers restart and
    later requests run), or the engine itself is gone (its workers could not restart, its prefix
    cache could not be reset, or the actor holding it died)."""
