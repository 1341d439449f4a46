"""Tensor-parallel serving: one process per rank over torch.distributed (gloo on CPU, NCCL on CUDA).

Rank 0 runs the engine (scheduler, sampler, HTTP); each step it broadcasts the batch (`comm.py`),
every rank runs its shard of the runtime (`runtime.py`: row-parallel layers all-reduce, logits are
gathered), and rank 0 samples once. `launch.py` starts the ranks and watches them.
"""
