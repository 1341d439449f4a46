"""`llmopt shard` on every family of stages/families.py. Each rank's tensors make a model of the family in
its local config (transformers builds it); with every layer's attention and MLP replaced by the sum of the
ranks' (what the all-reduce computes), the model's logits are the unsharded model's. Phi-3's fused qkv_proj
and gate_up_proj give each rank its rows of every section; Gemma 3's four norms and q/k norms go whole to
every rank; W4A16 codes are cut, never re-quantized."""
import copy
import json
import warnings

import pytest
import torch
from torch import nn

from llmopt.stages.artifact import Artifact
from llmopt.stages.errors import ConfigError
from llmopt.stages.families import family_of
from llmopt.stages.safetensors_io import load_dir
from llmopt.stages.shard.config import ShardConfig
from llmopt.stages.shard.plan import local_config
from llmopt.stages.shard.run import run_shard
from tests.stages.quantize.family_models import FAMILY_NAMES, write_family_dirs

IDS = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 200, 17, 4, 8, 12, 40, 41, 42, 43, 44, 45, 46, 47]])  # > the window


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """{family: (directory, model)}; Gemma 3 with its tied embedding, the others untied."""
    return write_family_dirs(tmp_path_factory.mktemp("families"), seed=6, tied=("gemma3",))


class SumOfRanks(nn.Module):
    """The ranks' modules on the same input, their outputs added: a row-parallel layer's all-reduce."""

    def __init__(self, parts):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, *args, **kwargs):
        outs = [p(*args, **kwargs) for p in self.parts]
        if isinstance(outs[0], tuple):
            return (sum(o[0] for o in outs), *outs[0][1:])
        return sum(outs)


def rank_models(art, model):
    """One transformers model per rank, built from the rank's local config and loaded from its folder."""
    from transformers import AutoModelForCausalLM

    config, plan = json.loads((art.path / "config.json").read_text()), art.tensor_parallel
    models = []
    for r, rank in enumerate(plan["ranks"]):
        local = type(model.config).from_dict(local_config(config, rank, plan))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = AutoModelForCausalLM.from_config(local).eval()
        state = load_dir(art.path, Artifact.open(art.path).rank_files(r))
        missing, unexpected = m.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        models.append((m, state))
    return models


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits  # the ranks of a layer share its layer index


@pytest.mark.parametrize("name", FAMILY_NAMES)
@pytest.mark.parametrize("tp", [2, 4])
def test_ranks_summed_give_the_unsharded_logits(sources, tmp_path, name, tp):
    path, source = sources[name]
    model = copy.deepcopy(source)  # its layers get the ranks' modules below
    art = run_shard(str(path), tmp_path / "tp", ShardConfig(tp))
    ranks = rank_models(art, model)
    family = family_of(model.config.to_dict())
    for m, state in ranks:
        for i in range(2):
            for norm in family.norms.values():  # every norm, whole, on every rank
                assert torch.equal(state[f"model.layers.{i}.{norm}.weight"],
                                   model.model.layers[i].get_submodule(norm).weight)
    embed = torch.cat([state["model.embed_tokens.weight"] for _, state in ranks])
    assert torch.equal(embed, model.model.embed_tokens.weight)
    reference = _logits(model)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn = SumOfRanks([m.model.layers[i].self_attn for m, _ in ranks])
        layer.mlp = SumOfRanks([m.model.layers[i].mlp for m, _ in ranks])
    head = torch.cat([m.lm_head.weight for m, _ in ranks])  # vocab-parallel: the ranks' rows in order
    assert torch.equal(head, model.lm_head.weight)
    torch.testing.assert_close(_logits(model), reference, atol=1e-4, rtol=1e-4)


def _generate(ref) -> list:
    from llmopt.stages.serve.build import build_engine
    from llmopt.stages.serve.engine.config import EngineConfig, SamplingParams

    engine = build_engine(str(ref), EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4), "cpu", torch.float32,
                          backend="reference")
    try:
        return engine.generate(["the quick brown fox", "a language model predicts"],
                               SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True))
    finally:
        ranks = getattr(engine.runner, "ranks", None)
        if ranks is not None:
            ranks.close()


@pytest.mark.parametrize("name", ["mistral", "qwen2", "qwen3", "phi3", "phi3-w4a16", "gemma3"])
def test_tp2_engine_matches_one_process(sources, tmp_path, name):
    """The serve engine's ranks (gloo, CPU) on the shards: the same greedy tokens and logprobs as one process."""
    from llmopt.stages.quantize.config import QuantizeConfig
    from llmopt.stages.quantize.run import run_quantize

    source = sources[name.split("-")[0]][0]
    if name.endswith("w4a16"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            source = run_quantize(str(source), tmp_path / "w4", QuantizeConfig(method="rtn", scheme="W4A16",
                                                                              group_size=16, eval_windows=0)).path
    reference = _generate(source)
    outputs = _generate(run_shard(str(source), tmp_path / "tp2", ShardConfig(2)).path)
    for ref, got in zip(reference, outputs):
        assert got.token_ids == ref.token_ids
        assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(ref.logprobs, got.logprobs))


def test_fused_phi3_w4a16_ranks_hold_their_rows_of_each_section(sources, tmp_path):
    """Rank 1 of 2 (query heads 2, 3 and KV head 1 of 16 dims; MLP channels 64..127): its fused rows are
    q 32..63, k 64+16..64+31, v 96+16..96+31 and gate 64..127, up 128+64..128+127, as codes of the source."""
    from llmopt.stages.compressed import decompress_linear, parse_schemes
    from llmopt.stages.quantize.config import QuantizeConfig
    from llmopt.stages.quantize.run import run_quantize

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = run_quantize(str(sources["phi3"][0]), tmp_path / "w4",
                                 QuantizeConfig(method="rtn", scheme="W4A16", group_size=16, eval_windows=0))
    art = run_shard(str(quantized.path), tmp_path / "w4-tp2", ShardConfig(2))
    source = load_dir(quantized.path, quantized.weight_files)
    rank = load_dir(art.path, Artifact.open(art.path).rank_files(1))
    qconfig = json.loads((quantized.path / "config.json").read_text())["quantization_config"]
    expected = {"self_attn.qkv_proj": ("rows", [*range(32, 64), *range(80, 96), *range(112, 128)]),
                "mlp.gate_up_proj": ("rows", [*range(64, 128), *range(192, 256)]),
                "self_attn.o_proj": ("cols", list(range(32, 64))), "mlp.down_proj": ("cols", list(range(64, 128)))}
    for linear, (kind, index) in expected.items():
        name = f"model.layers.1.{linear}"
        scheme = parse_schemes(qconfig, [name])[name]
        q, scale, _ = decompress_linear(source, name, scheme)
        mine, my_scale, _ = decompress_linear(rank, name, scheme)
        if kind == "rows":
            assert torch.equal(mine, q[index]) and torch.equal(my_scale, scale[index])
        else:
            assert torch.equal(mine, q[:, index]) and torch.equal(my_scale, scale[:, 2:4] if linear.endswith("o_proj")
                                                                   else scale[:, 4:8])


def test_an_architecture_the_runtime_does_not_run_is_refused(sources, tmp_path):
    import shutil

    src = tmp_path / "other"
    shutil.copytree(sources["llama"][0], src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "architectures": ["OtherForCausalLM"]}))
    with pytest.raises(ConfigError, match="shard: architecture OtherForCausalLM is not supported.*Gemma3ForCausalLM"):
        run_shard(str(src), tmp_path / "other-tp2", ShardConfig(2))
    assert not (tmp_path / "other-tp2").exists()
