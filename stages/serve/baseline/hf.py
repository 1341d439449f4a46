"""transformers `generate` as the baseline runs it: the model, the sampling arguments, static
left-padded batches (only tokens up to each sequence's EOS count), and batch-1 ms per token with the
prefill left out."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch


def model_dir(source: str) -> Path:
    """A directory transformers can load: an HF directory or artifact itself, else (alias, GGUF) its
    cached llmopt import."""
    from ...source import as_artifact, resolve

    path = Path(source).expanduser()
    if (path / "config.json").is_file():
        return path
    resolved = resolve(source)
    art = as_artifact(resolved)
    return art.path if art else resolved.path


def load_model(directory: Path, dtype: str | None = None, device: str = "cpu"):
    """The model in eval mode on `device`; dtype None or "auto" keeps the checkpoint's."""
    import warnings

    from transformers import AutoModelForCausalLM

    from ...model_io import parse_dtype

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=parse_dtype(dtype) or "auto")
    return model.to(device).eval()


def sampling_kwargs(max_tokens: int, ignore_eos: bool, temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """`generate`'s arguments for one request: greedy at temperature 0, exactly max_tokens with ignore_eos."""
    sample = temperature > 0
    return {"max_new_tokens": max_tokens, "min_new_tokens": max_tokens if ignore_eos else None,
            "do_sample": sample, "temperature": temperature if sample else None,
            "top_p": top_p if sample else None, "top_k": None}


def generated(ids: list[int], eos: set[int], limit: int, ignore_eos: bool = False) -> list[int]:
    """A generated row cut at `limit` and after its first EOS (padding after EOS is not output)."""
    out = []
    for token in ids[:limit]:
        out.append(token)
        if token in eos and not ignore_eos:
            break
    return out


def generate_batches(model, prompts: list[list[int]], limits: list[int], batch: int, eos: set[int], pad_id: int,
                     ignore_eos: bool = False, temperature: float = 0.0,
                     on_batch: Callable[[int, float], None] | None = None) -> tuple[list[list[int]], float]:
    """`generate` over `prompts` in static batches of `batch`, left-padded, in order: (each prompt's
    generated tokens, at most its limit, seconds for all). The batch runs to its longest sequence."""
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        rows, caps = prompts[i:i + batch], limits[i:i + batch]
        width = max(map(len, rows))
        ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=model.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=model.device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, eos_token_id=sorted(eos), pad_token_id=pad_id,
                                 **sampling_kwargs(max(caps), ignore_eos, temperature))
        outputs += [generated(row[width:].tolist(), eos, cap, ignore_eos) for row, cap in zip(out, caps)]
        if on_batch:
            on_batch(len(outputs), time.perf_counter() - start)
    return outputs, time.perf_counter() - start


def ms_per_token(model, prompts: list[list[int]], tokens: list[int]) -> list[float]:
    """Batch-1 decode per prompt: (time of generate(N + 1 tokens) - time of generate(1)) / N, so the
    prefill is left out; after one untimed warm-up generation."""
    def timed(ids: torch.Tensor, n: int) -> float:
        _sync(model.device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **sampling_kwargs(n, True))
        _sync(model.device)
        return time.perf_counter() - start

    timed(torch.tensor([prompts[0]], device=model.device), 4)
    per_prompt = []
    for prompt, n in zip(prompts, tokens):
        ids = torch.tensor([prompt], device=model.device)
        per_prompt.append((timed(ids, n + 1) - timed(ids, 1)) / n * 1e3)
    return per_prompt


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
