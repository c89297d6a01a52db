"""Reliability tooling: the soak (hours of mixed, misbehaving clients against one runtime, with
its RSS and abort-latency figures) and the hostile-input sweep (every class of bad request,
counted by the error code it earned). Benchmarks of speed live in `radixrt.bench`."""
