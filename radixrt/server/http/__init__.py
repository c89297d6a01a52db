"""The HTTP gateway (OpenAI-compatible and SGLang-native (FastAPI + uvicorn) in front of a runtime.

Modules: `schemas` (request bodies), `responses` (OpenAI shapes), `errors` (codes -> statuses),
`app` (routes), `native` (SGLang's native routes: /generate, /flush_cache, ...), `process` (the
child process). Importing this package loads none of them.

`radixrt serve` binds the HTTP socket (`--port`) and hands it to a child process
(`radixrt http-gateway`): the scheduler must keep its own process's main thread, so the HTTP front
lives next to it and speaks the ZeroMQ protocol through `RuntimeEndpoint`, like any other client.
"""
