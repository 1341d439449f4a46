"""The serve engine: request bookkeeping, paged-KV block manager, continuous-batching scheduler,
sampling, detokenisation and the sync/async engine API (modules import torch only where needed)."""
