"""`llmopt bench --offline`: the serve engine in-process, no HTTP, against plain transformers.

config.py holds the options (the prompt options are the online bench's own), prompts.py turns the
bench's dataset into token ids, engine.py and baseline.py time the two sides, report.py builds the
JSON report and run.py runs the sources side by side. Throughput by default; `--max-concurrency 1`
is batch-1 decode (ms per token, the prefill left out).
"""
