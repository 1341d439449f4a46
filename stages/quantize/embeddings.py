"""`--embeddings int8`: the input embedding matrix as RTN int8, symmetric, group-wise along the hidden size;
`--embeddings auto` (the default) chooses int8 where the embedding is a large share of the model.

Not layer by layer: the embedding sits outside the decoder layers, so it is quantized once after them.
In a tied model the lm_head is the same matrix, so it is written once, quantized, and readers tie the
lm_head to it (the serve engine runs it through the int8 GEMV). An untied lm_head stays dense.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..compressed import LinearScheme, compress_linear
from ..errors import ConfigError
from ..model_io import count_parameters
from .config import AUTO
from .rtn import QuantArgs, compute_qparams, dequantize, quantize, resolve_group_size

EMBED = "model.embed_tokens"
# --embeddings auto takes int8 where the input embedding holds more than this share of the parameters (a
# large vocabulary: Gemma 3 270M's 262144 x 640 is 63%; SmolLM2-135M's 49152 x 576 is 21% and stays as is).
AUTO_INT8_SHARE = 1 / 3


@dataclass(frozen=True)
class EmbeddingsChoice:
    """What --embeddings came to for one model, and why (the manifest's metrics.quantization.embeddings_choice)."""

    requested: str  # keep | int8 | auto
    chosen: str  # keep | int8
    share: float | None  # the embedding's share of the parameters (None: the model has no EMBED)

    def record(self) -> dict:
        return {"requested": self.requested, "chosen": self.chosen, "threshold": round(AUTO_INT8_SHARE, 6),
                "embedding_share": None if self.share is None else round(self.share, 6)}


def choose_embeddings(model, requested: str, method: str) -> EmbeddingsChoice:
    """Resolve `requested` for `model`: an explicit keep or int8 as given; auto: int8 where the embedding is
    more than AUTO_INT8_SHARE of the parameters (a tied lm_head counted once), keep otherwise, and keep for
    bnb (which cannot write int8 embeddings) or a model without EMBED."""
    try:
        share = model.get_submodule(EMBED).weight.numel() / count_parameters(model)
    except AttributeError:
        share = None
    if requested != AUTO:
        return EmbeddingsChoice(requested, requested, share)
    large = share is not None and share > AUTO_INT8_SHARE and method != "bnb"
    return EmbeddingsChoice(requested, "int8" if large else "keep", share)


@dataclass
class QuantizedEmbedding:
    """What export needs: the compressed tensors, the scheme, the state-dict keys they replace."""

    tensors: dict[str, torch.Tensor]
    scheme: LinearScheme
    replaces: set[str]  # model.embed_tokens.weight, and lm_head.weight when tied
    rel_weight_error: float

    def record(self) -> dict:
        """The manifest's entry (metrics.quantization.embeddings)."""
        return {EMBED: {"bits": self.scheme.bits, "group_size": self.scheme.group_size,
                        "symmetric": self.scheme.symmetric, "rel_weight_error": round(self.rel_weight_error, 6),
                        "tied_lm_head": "lm_head.weight" in self.replaces}}


def quantize_embedding(model, mode: str) -> QuantizedEmbedding | None:
    """Quantize `model`'s input embedding for `mode` ("keep": None); leaves the dequantized matrix in
    the model, as the layer methods do with their Linears."""
    if mode == "keep":
        return None
    try:
        embedding = model.get_submodule(EMBED)
    except AttributeError:
        raise ConfigError(f"--embeddings {mode}: {type(model).__name__} has no {EMBED}") from None
    weight = embedding.weight
    w = weight.data.float()  # [vocab, hidden]
    args = QuantArgs(bits=8, group_size=resolve_group_size(w.shape[1], None, layer=EMBED), symmetric=True,
                     scale_dtype=weight.dtype)
    scale, _ = compute_qparams(w, args)  # [vocab, hidden/g]
    # Symmetric: an exact zero (pruned) rounds to code 0, which dequantizes to exactly 0 again.
    q = quantize(w, scale, None, args)
    deq = dequantize(q, scale, None, args).to(weight.dtype)
    error = ((deq.float() - w).norm() / w.norm().clamp_min(1e-12)).item()
    scheme = LinearScheme(args.bits, args.group_size, args.symmetric, activations=False)
    replaces = {n for n, p in model.named_parameters(remove_duplicate=False) if p is weight}
    weight.data = deq
    return QuantizedEmbedding(compress_linear(EMBED, q, scale, None, scheme, weight.dtype), scheme, replaces, error)
