"""The quantize stage: pure algorithms (rtn, gptq, awq, smoothquant, fold), the layer methods that
apply them, and `run.run_quantize` which drives them layer by layer into an artifact."""
