"""pd-loadgen: an OpenAI-compatible load generator for comparing P/D with colocated serving.

Pure logic (workload shapes, arrival times, SSE timing, statistics) lives apart from I/O
(HTTP client, runner, files, plots) so the numbers can be unit-tested on known inputs.
Metric definitions follow vLLM's own benchmark client (``vllm/benchmarks/serve.py``) so
results from both tools compare; see docs/load-testing.md.
"""
