"""The profile stage: where a model's time and memory go on the serve engine, against the
machine's own limits (copy bandwidth, GEMM throughput), with a capacity plan and an HTML report.

config (ProfileConfig) -> run.run_profile (sweeps, breakdown, costs, capacity: pure measurement
and arithmetic) -> a JSON-able report -> tables (rows for any renderer) and html (the report file).
"""
