"""`llmopt profile --synthetic SHAPE --check-greedy`: the engine's greedy tokens on --device in --dtype
against the CPU fp32 path, on the same random weights.

PROMPTS random prompts (8, 13, 18, ... tokens) go to the engine together, each for --decode-steps
(preset 32) greedy tokens with EOS ignored: once on CPU in fp32 (the reference, which also reports each
step's two most likely tokens) and once on the device and dtype asked for, with --backend. The rule is
the engine tests' near-tie rule (tests/integration/test_engine_smollm2.py): a prompt's tokens must equal
the reference's; where they first differ, the reference's two best logits must lie within the near-tie
margin of each other (a tie the candidate's rounding may break the other way), and after that the two
continue from different contexts and are not compared. The margin is the tests' 1e-3 in fp32; in a
16-bit dtype it is a few times the largest log-probability error its path showed against fp32 on this
model (NEAR_TIE; bf16 on CPU: at most 0.008, while the median gap between the two best is 0.08). The
weights are the synthetic model's N(0, 0.02): wider ones grow the logits, and a 16-bit dtype's rounding
with them, faster than the gaps between them.
"""
from __future__ import annotations

import torch

from ..progress import StageHooks
from .config import ProfileConfig
from .tables import TableData

PROMPTS = 8
DEFAULT_LAYERS = 2
NEAR_TIE = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def first_difference(tokens: list[int], reference: list[int]) -> int | None:
    """The first step where the two differ (a length difference counts), or None."""
    diff = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)
    if diff is None and len(tokens) != len(reference):
        return min(len(tokens), len(reference))
    return diff


def compare(tokens: list[int], reference: list[int], top2: list[tuple[float, float]], margin: float) -> dict:
    """One prompt under the near-tie rule: `top2[i]` holds the reference's two best log-probabilities at
    step i (their difference is that of the logits)."""
    diff = first_difference(tokens, reference)
    if diff is None:
        return {"same": len(reference), "ok": True, "gap": None}
    if diff >= min(len(tokens), len(reference)):  # one ran shorter: no tie explains that
        return {"same": diff, "ok": False, "gap": None}
    gap = top2[diff][0] - top2[diff][1]
    return {"same": diff, "ok": gap < margin, "gap": gap}


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (8 + 5 * i,), generator=g).tolist() for i in range(PROMPTS)]


def greedy(model: dict, state: dict, device: torch.device, dtype: torch.dtype, backend: str, ids: list[list[int]],
           steps: int, top: int | None, enforce_eager: bool = False):
    """The engine's final outputs for every prompt, submitted together."""
    from ..serve.engine.config import SamplingParams
    from .synthetic import make_engine

    engine, _ = make_engine(model, state, device, dtype, backend, len(ids), max(map(len, ids)) + steps, enforce_eager)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True, logprobs=top)
    return engine.generate(ids, params)


def run_greedy_check(config: ProfileConfig, hooks: StageHooks | None = None) -> dict:
    """Greedy tokens on the asked device and dtype against CPU fp32 (see the module docstring)."""
    from ..model_io import parse_dtype
    from .machine import describe
    from .synthetic import model_config, random_state

    hooks = hooks or StageHooks()
    device, dtype = torch.device(config.device), parse_dtype(config.dtype) or torch.bfloat16
    model = model_config(config.synthetic, config.layers or DEFAULT_LAYERS)
    state = random_state(model, torch.device("cpu"), torch.float32)  # drawn once on CPU, for both sides
    ids, steps = prompts(model["vocab_size"]), config.decode_steps
    hooks.status(f"reference: {len(ids)} prompts x {steps} greedy tokens on cpu, float32")
    reference = greedy(model, state, torch.device("cpu"), torch.float32, "auto", ids, steps, top=2)
    hooks.status(f"candidate: the same on {device}, {str(dtype).removeprefix('torch.')}, backend {config.backend}")
    candidate = greedy(model, state, device, dtype, config.backend, ids, steps, top=None,
                       enforce_eager=config.enforce_eager)
    margin = NEAR_TIE.get(dtype, NEAR_TIE[torch.bfloat16])
    rows = []
    for ref, out in zip(reference, candidate):
        top2 = [(lp.top[0][1], lp.top[1][1]) for lp in ref.logprobs]
        rows.append({"prompt_tokens": ref.num_prompt_tokens, **compare(list(out.token_ids), list(ref.token_ids),
                                                                       top2, margin)})
    return {"tool": "llmopt profile --synthetic --check-greedy", "shape": config.synthetic, "layers": model[
        "num_hidden_layers"], "dtype": str(dtype), "machine": describe(device), "backend": config.backend,
            "tokens": steps, "margin": margin, "rows": rows, "exact": sum(r["same"] == steps for r in rows),
            "passed": all(r["ok"] for r in rows), "config": config.to_dict()}


def greedy_tables(report: dict) -> list[TableData]:
    dtype = report["dtype"].removeprefix("torch.")
    t = TableData("greedy", f"greedy tokens on {report['machine']['device']} {dtype} against cpu float32, synthetic "
                            f"{report['shape']} x {report['layers']} layers", ["prompt tokens", "equal steps",
                                                                                "gap at the first difference", "ok"])
    t.rows = [[str(r["prompt_tokens"]), f"{r['same']} of {report['tokens']}",
               "-" if r["gap"] is None else f"{r['gap']:.2e}", "yes" if r["ok"] else "NO"] for r in report["rows"]]
    t.note = (f"{report['exact']} of {len(report['rows'])} prompts equal throughout; a difference passes only "
              f"at a near-tie (the reference's two best logits within {report['margin']:g}): "
              f"{'PASSED' if report['passed'] else 'FAILED'}")
    return [t]
