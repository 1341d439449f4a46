"""Every family of stages/families.py through the serve engine against transformers' own model class.

For each family a tiny random model of HF's class (2-3 layers), 5 prompts x 32 greedy tokens, EOS ignored:
the engine's tokens must equal a plain transformers greedy loop's, but at a near-tie (where they first
differ, the reference's two best log-probabilities lie within the margin: 1e-3 in fp32, the bf16 margin for
a W4A16 artifact on the CPU fast path, which rounds activations to bf16). The W4A16 reference is transformers
on the artifact's dequantized weights. Windowed variants (Mistral, Gemma 3's local layers) take prompts
longer than their window, so the window decides the tokens.
"""
import warnings

import pytest
import torch

from llmopt.stages.profile.greedy import NEAR_TIE, compare
from llmopt.stages.serve.build import build_engine
from llmopt.stages.serve.engine.config import EngineConfig, SamplingParams
from tests.stages.serve.runner_steps import save_hf

VOCAB, NEW_TOKENS, WINDOW = 300, 32, 16
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=0, bos_token_id=0,
            pad_token_id=0)
FAMILIES = {  # name: (config class, model class, config overrides)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=None, tie_word_embeddings=False)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=WINDOW, query_pre_attn_scalar=24, architectures=["Gemma3ForCausalLM"],
        tie_word_embeddings=False)),  # tied, random weights repeat the prompt's tokens: test_model.py checks tied
}


def build(name: str, seed: int = 0):
    import transformers

    config_cls, model_cls, extra = FAMILIES[name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**BASE, **extra}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # wider than HF's init, so logits have gaps and a wrong op shows
        for pname, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)
            elif "norm" in pname:
                p.copy_(0.2 * torch.randn(p.shape, generator=g) + (0.0 if name == "gemma3" else 1.0))
    return model.eval()


def prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (9 + 7 * i,), generator=g).tolist() for i in range(5)]  # 9..37 > WINDOW


@torch.inference_mode()
def reference(model, prompt: list[int], new_tokens: int = NEW_TOKENS):
    """Greedy tokens and each step's two best log-probabilities, transformers' own loop and cache (EOS
    ignored: `generate` would stop there, or with min_new_tokens never pick it)."""
    from transformers import DynamicCache

    cache, ids, tokens, top2 = DynamicCache(config=model.config), torch.tensor([prompt]), [], []
    for _ in range(new_tokens):
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1].float()
        best = torch.log_softmax(logits, -1).topk(2).values
        top2.append((float(best[0]), float(best[1])))
        tokens.append(int(logits.argmax()))
        ids = torch.tensor([[tokens[-1]]])
    return tokens, top2


def engine_tokens(path, backend: str = "auto") -> list[list[int]]:
    engine = build_engine(str(path), EngineConfig(block_size=4, num_blocks=128), dtype=torch.float32,
                          backend=backend)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [list(out.token_ids) for out in engine.generate(prompts(), params)]


def check(ours, model, margin):
    assert len({t for tokens in ours for t in tokens}) >= 30, "a degenerate model (it repeats a few tokens)"
    rows = [compare(tokens, *reference(model, p), margin) for tokens, p in zip(ours, prompts())]
    bad = [(i, r) for i, r in enumerate(rows) if not r["ok"]]
    assert not bad, f"prompts differ beyond a near-tie: {bad}"
    return rows


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    model = build(request.param)
    return request.param, model, save_hf(model, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_dense_greedy_tokens_equal_transformers(family, backend):
    name, model, path = family
    rows = check(engine_tokens(path, backend), model, NEAR_TIE[torch.float32])
    assert sum(r["same"] for r in rows) >= 4 * NEW_TOKENS  # most prompts equal all the way


def test_w4a16_greedy_tokens_equal_transformers_on_the_dequantized_weights(family, tmp_path):
    from llmopt.stages.model_io import load_model_dir
    from llmopt.stages.quantize.config import QuantizeConfig
    from llmopt.stages.quantize.run import run_quantize

    name, _, path = family
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        art = run_quantize(str(path), tmp_path / "w4", QuantizeConfig(method="rtn", eval_windows=0, scheme="W4A16",
                                                                       group_size=16)).path
        dequantized = load_model_dir(art).eval()
    check(engine_tokens(art, "reference"), dequantized, NEAR_TIE[torch.float32])  # exact dequantized matmuls
    check(engine_tokens(art), dequantized, NEAR_TIE[torch.bfloat16])  # the fast path: bf16 activations


LONG = 160  # new tokens of the long generation: ten windows


@pytest.mark.parametrize("name", ["mistral-window", "gemma3"])
def test_windowed_layers_hold_a_window_of_blocks_through_a_long_generation(name, tmp_path):
    """Read from the block manager at every step: the windowed groups' blocks stay within the window (and the
    block its first position is in, and the one the next token opens); the full groups' grow with the
    sequence; the tokens equal transformers' all the way."""
    model = build(name)
    engine = build_engine(str(save_hf(model, tmp_path / name)), EngineConfig(block_size=4, num_blocks=512),
                          dtype=torch.float32)
    prompt = prompts()[1]
    engine.add_request("long", params=SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True),
                       prompt_token_ids=prompt)
    bm, windows = engine.scheduler.block_manager, engine.runner.kv_windows
    assert WINDOW in windows
    most, tokens = [0] * len(windows), []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.token_ids  # the tokens new this step
        for seq in engine.scheduler.running:
            for g in range(len(windows)):
                most[g] = max(most[g], bm.held_blocks(seq, g))
    for g, window in enumerate(windows):
        if window:  # a window's worth, not the sequence's 44 blocks
            assert WINDOW // 4 <= most[g] <= WINDOW // 4 + 2, (g, most)
        else:
            assert most[g] == bm.blocks_for(len(prompt) + LONG - 1), (g, most)
    assert bm.num_free_blocks == bm.num_blocks  # everything given back at the end
    result = compare(tokens, *reference(model, prompt, LONG), NEAR_TIE[torch.float32])
    assert result["ok"] and result["same"] >= LONG // 2, result  # equal, or a near-tie late in the generation
