"""The eval stage: perplexity (and KL against a reference) under the GPTQ-style window protocol.

config (EvalConfig and its options: one text or a list of them) -> texts (the evaluation sets: WikiText-2,
the Python standard library, chat prompts through the model's template) -> perplexity (the math: windows, NLL,
KL) -> measure.evaluate (one model on one text) -> run.run_evals (load a source once, measure it on each text,
store each result in its manifest), the one entry point of `llmopt eval` and of a recipe's eval stage.
before_after holds the quick perplexity that quantize and prune record.
"""
