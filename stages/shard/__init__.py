"""`llmopt shard`: split an artifact for tensor- and pipeline-parallel serving (plans, slicing, the stage)."""
