"""The prune stage: pure mask and reconstruction math (masks, sparsegpt, structured), the layer
methods that apply it through the shared layer-by-layer driver (methods), and `run.run_prune`
which writes the pruned model as a plain dense artifact.

Unstructured and N:M zeros keep accuracy but make nothing faster on today's serving runtimes;
structured pruning (MLP channels, whole layers) writes a genuinely smaller model that is faster
everywhere.
"""
