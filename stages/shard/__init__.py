"""`llmopt shard`: split an artifact for tensor-parallel serving (plan, slicing, the stage)."""
