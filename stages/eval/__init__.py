"""The eval stage: perplexity (and KL against a reference) under the GPTQ-style window protocol.

config (EvalConfig and its options) -> perplexity (the protocol: texts, windows, NLL, KL) -> run.run_eval
(load a source, measure it, store the result in its manifest), the one entry point of `llmopt eval` and
of a recipe's eval stage. before_after holds the quick perplexity that quantize and prune record.
"""
