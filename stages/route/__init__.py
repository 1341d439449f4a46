"""`llmopt route`: one OpenAI-compatible endpoint in front of llmopt serve replicas on any machines."""
