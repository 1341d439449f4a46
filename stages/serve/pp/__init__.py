"""Pipeline-parallel serving: one process per stage (times its tensor-parallel ranks) over torch.distributed.

Each stage holds a contiguous run of decoder layers (`llmopt shard --pp N`) and the KV cache of those layers.
Rank 0 runs the engine and stage 0: for every micro-batch it sends the step's metadata to every rank
(`comm.py`), runs its layers and hands the residual stream on; each later stage runs its layers on what the
stage before sent, and the last stage's logits come back to rank 0, which samples. The engine keeps up to
`pp` micro-batches in flight (engine.py), so that in a steady state every stage works on a different one.
"""
