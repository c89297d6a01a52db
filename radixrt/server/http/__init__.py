"""OpenAI-compatible HTTP gateway (FastAPI + uvicorn) in front of a runtime.

Modules: `schemas` (request bodies), `responses` (OpenAI shapes), `errors` (codes -> statuses),
`app` (routes), `process` (the child process). Importing this package loads none of them.

`radixrt serve --http-port P` binds the HTTP socket and hands it to a child process
(`radixrt http-gateway`): the scheduler must keep its own process's main thread, so the HTTP front
lives next to it and speaks the ZeroMQ protocol through `RuntimeEndpoint`, like any other client.
"""
