"""`llmopt export`: an artifact as a GGUF file for llama.cpp (exact re-packing of its integer codes)."""
