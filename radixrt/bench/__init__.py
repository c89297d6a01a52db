"""Serving benchmarks: workloads, load generators, the four metrics, peers and plots.

`config.BenchConfig` is the command line (light: every `radixrt` command builds its parser);
`runner.run_bench` runs one (torch and the suites load there)."""
