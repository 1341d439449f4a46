"""llmopt bench: a load generator for any OpenAI-compatible server.

A pure HTTP client: it imports nothing of the serve engine (`--server` starts `llmopt serve` as a
subprocess). dataset -> arrival schedule -> streaming requests -> per-request timings -> metrics,
gates and comparisons. stage.py holds the stage's options and config, run.py its one run (a server
per source, the load, the report, the --fail-on check) for `llmopt bench` and recipes alike.
"""
