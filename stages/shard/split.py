"""One rank's tensors under a split plan: slices of the checkpoint, dense or compressed-tensors.

Quantized Linears are split on their integer codes, never re-quantized: column-parallel layers take
whole output rows (codes, scales and zero points of those rows); row-parallel layers take input
columns on group boundaries (their scale and zero-point columns go with them), and per-channel
scales, which belong to output rows, are kept whole on every rank. An int8 embedding (and its tied
lm_head) is split like a column-parallel layer: vocabulary rows of codes and scales.

The layer's tensor names come from its Family (stages/families.py). A fused Linear (Phi-3's qkv_proj, rows
q || k || v, and gate_up_proj, gate || up) gives each rank its own rows of every section, in the same order, so
a rank's qkv_proj is q_local || k_local || v_local: the fused layout of its local config. Norms are copied
whole (q/k norms are per head_dim, so every rank needs all of them).
"""
from __future__ import annotations

import torch

from ..compressed import LinearScheme, compress_linear, decompress_linear
from ..families import Family

ROW_PARALLEL = ("o", "down")  # sections whose input columns are split (the rest: output rows)


def head_rows(heads: list[int], head_dim: int) -> torch.Tensor:
    """Row indices of the given heads in a [heads * head_dim, ...] projection."""
    return torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in heads])


class RankSlicer:
    """Cuts the tensors of `state` (HF names, laid out as `family` says) for one rank of `plan`."""

    def __init__(self, state: dict, schemes: dict[str, LinearScheme], plan: dict, rank: int, family: Family):
        self.state, self.schemes, self.plan, self.family = state, schemes, plan, family
        self.rank = plan["ranks"][rank]
        d = plan["head_dim"]
        heads, kv_heads = head_rows(self.rank["q_heads"], d), head_rows(self.rank["kv_heads"], d)
        mlp = torch.arange(*self.rank["mlp"])
        # this rank's rows of each section (o, down: its input columns), counted from the section's start
        local = {"q": heads, "k": kv_heads, "v": kv_heads, "o": heads, "gate": mlp, "up": mlp, "down": mlp}
        starts = family.section_rows(plan["hidden_size"], plan["num_heads"] * d, plan["num_kv_heads"] * d,
                                     plan["intermediate_size"])
        self.cuts = {}  # Linear under the layer -> ("rows" | "cols", indices)
        for name, sections in family.sections().items():
            if sections[0] in ROW_PARALLEL:
                self.cuts[name] = ("cols", local[sections[0]])
            else:  # a fused Linear: each section's local rows, shifted to where the section starts
                self.cuts[name] = ("rows", torch.cat([local[s] + starts[s][1] for s in sections]))

    def layer(self, prefix: str) -> dict:
        """Every tensor of decoder layer `prefix` (model.layers.i) for this rank."""
        out = {}
        for name, (kind, index) in self.cuts.items():
            out.update(self.linear(f"{prefix}.{name}", **{kind: index}))
        for norm in self.family.norms.values():
            out[f"{prefix}.{norm}.weight"] = self.state[f"{prefix}.{norm}.weight"]
        return out

    def vocab(self, name: str) -> dict:
        """The embedding or an lm_head: this rank's vocabulary rows."""
        v0, v1 = self.rank["vocab"]
        if f"{name}.weight" in self.state and name not in self.schemes:
            return {f"{name}.weight": self.state[f"{name}.weight"][v0:v1]}
        return self.linear(name, rows=torch.arange(v0, v1))

    def linear(self, name: str, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> dict:
        """One Linear's entries, cut to `rows` (column-parallel) or input `cols` (row-parallel)."""
        scheme = self.schemes.get(name)
        out = {}
        bias = self.state.get(f"{name}.bias")
        if bias is not None:  # row-parallel: every rank holds it, the runtime adds it after the reduction
            out[f"{name}.bias"] = bias if rows is None else bias[rows]
        if scheme is None:
            w = self.state[f"{name}.weight"]
            out[f"{name}.weight"] = w[rows] if rows is not None else w[:, cols]
            return out
        q, scale, zero = decompress_linear(self.state, name, scheme)
        if rows is not None:
            q, scale, zero = q[rows], scale[rows], None if zero is None else zero[rows]
        else:
            q, scale, zero = _cut_columns(q, scale, zero, cols)
        out.update(compress_linear(name, q, scale, zero, scheme, dtype=scale.dtype))
        return out


def _cut_columns(q, scale, zero, cols: torch.Tensor):
    """Input columns `cols` (a contiguous range on group boundaries) of codes and their groups."""
    in_features, groups = q.shape[1], scale.shape[1]
    q = q[:, cols]
    if groups == 1:  # per channel: the scale belongs to the whole output row
        return q, scale, zero
    g = in_features // groups
    gcols = torch.arange(int(cols[0]) // g, (int(cols[-1]) + 1) // g)
    return q, scale[:, gcols], None if zero is None else zero[:, gcols]
