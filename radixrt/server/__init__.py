"""The runtime process's front: the ZeroMQ server (`zmq_server`), the OpenAI-compatible HTTP
gateway (`http`), Prometheus metrics. Nothing is imported here: the gateway's process must not
load the engine (and torch) that the ZeroMQ server needs."""
