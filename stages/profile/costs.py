"""What a step must move and compute, from the runtime's modules and its ModelSpec (no timing).

Weight bytes are those of the tensors the step's kernels actually stream: a dense weight once
(its CPU layouts are copies of one matrix, and one of them is read per call), the packed int4/int8
layout of a quantized linear's CPU kernel (or its compressed tensors where no kernel applies),
the norms (every one the model's family has: Gemma 3's four per layer and q/k norms), and the lm_head
(for tied embeddings: the whole embedding matrix). The embedding lookup reads only one row per sequence
and is left out. Logical counts (MACs, parameters) come from the family's Linears (stages/families.py):
Phi-3's fused qkv_proj and gate_up_proj count what Llama's q/k/v and gate/up do.
"""
from __future__ import annotations

from dataclasses import fields, is_dataclass

import torch

from ..serve.model import NORM_BUFFERS, ConcatLinear, ModelSpec, Runtime
from ..serve.runner import kv_bytes_per_block

PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def linear_bytes(module) -> int:
    """Bytes of weight (and bias) one forward of a projection module reads."""
    if isinstance(module, ConcatLinear):
        return sum(linear_bytes(p) for p in module.parts)
    cpu = getattr(module, "cpu_weight", None)
    if is_dataclass(cpu):
        kernel = [getattr(cpu, f.name) for f in fields(cpu)]
        if any(torch.is_tensor(t) for t in kernel):  # the kernel's own layout (opaque prepacks: buffers)
            return tensor_bytes(kernel + [module.bias])
    return tensor_bytes(module.buffers(recurse=False))


def weight_bytes(runtime: Runtime) -> dict:
    """Weight bytes one decode step reads, by part; `total` is the roofline's numerator."""
    layers = [sum(linear_bytes(getattr(layer, p)) for p in PROJECTIONS) for layer in runtime.layers]
    norms = tensor_bytes([runtime.norm]) + sum(tensor_bytes([getattr(l, n) for n in NORM_BUFFERS.values()])
                                               for l in runtime.layers)
    lm_head = linear_bytes(runtime.lm_head)
    return {"decoder_layers": sum(layers), "norms": norms, "lm_head": lm_head,
            "total": sum(layers) + norms + lm_head, "per_layer": layers}


def kv_bytes_per_token(spec: ModelSpec, dtype: torch.dtype) -> int:
    """Cache bytes one token takes over all layers (keys and values): a block's bytes per KV layer group times
    the groups (a windowed group's tokens beyond its window are given back while a sequence generates, but a
    prompt that long holds them all at admission)."""
    return kv_bytes_per_block(spec, 1, dtype) * spec.shape.kv.count


def layer_linear_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """Each Linear of one decoder layer, as the model's family names it -> (output rows, input columns)."""
    return spec.family.linear_shapes(spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size)


def linear_macs_per_token(spec: ModelSpec) -> int:
    """Multiply-adds of one token through the decoder layers' projections (lm_head apart)."""
    return spec.num_layers * sum(rows * cols for rows, cols in layer_linear_shapes(spec).values())


def attention_flops(spec: ModelSpec, queries_keys: int) -> int:
    """FLOPs of QK^T and PV for `queries_keys` (query, key) pairs, over all heads and layers."""
    return 4 * queries_keys * spec.num_heads * spec.head_dim * spec.num_layers


def prefill_flops(spec: ModelSpec, prompt_len: int) -> int:
    """One sequence of `prompt_len` new tokens (causal attention), logits of its last token only."""
    pairs = prompt_len * (prompt_len + 1) // 2
    return 2 * linear_macs_per_token(spec) * prompt_len + attention_flops(spec, pairs) \
        + 2 * spec.hidden_size * spec.vocab_size


def decode_flops(spec: ModelSpec, batch: int, context: int) -> int:
    """`batch` sequences bring one token each and attend over `context` cached tokens (their own included)."""
    per_token = 2 * linear_macs_per_token(spec) + 2 * spec.hidden_size * spec.vocab_size
    return batch * per_token + attention_flops(spec, batch * context)


def parameter_count(spec: ModelSpec) -> int:
    """Logical parameters (untied lm_head counted separately), whatever the storage format."""
    embed = spec.vocab_size * spec.hidden_size
    norms = spec.hidden_size + spec.num_layers * sum(spec.family.norm_sizes(spec.hidden_size, spec.head_dim).values())
    return linear_macs_per_token(spec) + embed + norms + (0 if spec.tie_word_embeddings else embed)
