"""The engine: `EngineCore` (scheduler + hybrid KV coordinator + executor), its clients and outputs.

Callers send frozen `EngineRequest`s through one `EngineClient` (in-process, asyncio or a Ray
actor) and read a stream of vLLM-shaped `RequestOutput`s back.
"""
