"""Plain transformers, no engine: the baseline every llmopt speed-up is measured against.

hf.py is the one place transformers `generate` runs for a measurement: in static left-padded
batches and one prompt at a time (`llmopt bench --offline`), and with a streamer behind the baseline
server (worker.py, app.py), which `python -m llmopt.stages.serve.baseline SOURCE --port P` starts and
`llmopt bench --server SOURCE --engine hf` drives.
"""
