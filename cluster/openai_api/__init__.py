"""The OpenAI API's shapes and their meaning, shared by every entry point that speaks it.

`protocol.py` holds the request and response bodies (pydantic, vLLM's extra fields included);
`sampling.py` maps a request's sampling fields to the engine's `SamplingParams`. The Serve
ingress and replica, the batch runner (OpenAI batch lines are validated with these models) and
the engine's input processor all use them, so they accept and reject the same things.
"""
