"""vLLM's serve conventions: -tp N splits an unsharded source at load time, --gpu-memory-utilization sizes
the KV cache, --config FILE.yaml gives options; vllm-style invocations work unchanged."""
import pytest
import torch
import yaml

from llmopt.cli.main import main
from llmopt.stages.errors import ConfigError
from llmopt.stages.serve import runner as runner_module
from llmopt.stages.serve.engine.config import EngineConfig, SamplingParams
from tests.stages.serve.test_kv_plan import SPEC, runtime
from tests.stages.serve.test_serve_config import Built, captured  # noqa: F401  (a fixture)

BLOCK = 16 * 11520 * 2  # one bf16 block of SmolLM2's cache shape (test_kv_plan.SPEC)


@pytest.fixture
def seen(captured, monkeypatch):  # noqa: F811
    """What build_engine gets, tensor_parallel_size included."""
    import llmopt.stages.serve.build as build

    stand_in = build.build_engine

    def build_engine(source, config, *args, tensor_parallel_size=1, **kwargs):
        captured["tp_size"] = tensor_parallel_size
        return stand_in(source, config, *args, **kwargs)

    monkeypatch.setattr(build, "build_engine", build_engine)
    return captured


VLLM_INVOCATIONS = [  # as a vLLM user types them; what each must give the engine
    (["-tp", "2"], {"tp_size": 2}),
    (["--tensor-parallel-size", "2", "--max-model-len", "128"], {"tp_size": 2, "max_model_len": 128}),
    (["--gpu-memory-utilization", "0.9", "--max-num-seqs", "8"], {"gpu_memory_utilization": 0.9, "max_num_seqs": 8}),
    (["--kv-cache-memory", "1GiB", "--enforce-eager"], {"kv_cache_memory": "1GiB", "enforce_eager": True}),
]


@pytest.mark.parametrize("argv, expected", VLLM_INVOCATIONS)
def test_vllm_style_serve_invocations_work_unchanged(seen, tiny_hf, argv, expected):
    assert main(["serve", str(tiny_hf[0]), *argv]) == 0
    engine = seen["engine"][0]
    assert seen["tp_size"] == expected.pop("tp_size", 1)
    assert {name: getattr(engine, name) for name in expected} == expected


def test_config_file_gives_options_and_the_command_line_wins(seen, tiny_hf, tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"model": str(tiny_hf[0]), "max-num-seqs": 8, "kv_cache_memory": 0.5,
                                    "--port": 9001, "tensor-parallel-size": 2, "served-model-name": "tiny"}))
    assert main(["serve", str(tiny_hf[0]), "--config", str(path), "--port", "9002"]) == 0
    engine, server = seen["engine"][0], seen["server"]
    assert (engine.max_num_seqs, engine.kv_cache_memory, seen["tp_size"]) == (8, "0.5", 2)
    assert (server.port, server.served_model_name) == (9002, "tiny")  # the command line's port


@pytest.mark.parametrize("content, message", [
    ({"max-num-seq": 8}, "'max-num-seq' is no option of llmopt serve"),
    ({"max-num-seqs": "eight"}, "--max-num-seqs: expected a whole number"),
    ({"model": "another-model"}, "is not SOURCE"),
    (["port", 1], "expected a mapping"),
])
def test_a_bad_config_file_is_one_line_and_exit_2(tiny_hf, tmp_path, capsys, content, message):
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(content))
    assert main(["serve", str(tiny_hf[0]), "--config", str(path)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("error: --config") or err.startswith("error: --max-num-seqs"), err
    assert message in err


def memory(monkeypatch, total: int, free: int) -> None:
    monkeypatch.setattr(runner_module, "total_memory_bytes", lambda device: total)
    monkeypatch.setattr(runner_module, "free_memory_bytes", lambda device: free)


def test_gpu_memory_utilization_leaves_the_cache_what_the_share_has_left(monkeypatch):
    from llmopt.stages.serve.build import kv_cache_plan

    memory(monkeypatch, total=100 * BLOCK, free=60 * BLOCK)  # 40 blocks' worth in use (the weights)
    plan = kv_cache_plan(EngineConfig(gpu_memory_utilization=0.5), SPEC, runtime(), announce=False)
    assert plan.num_blocks == 10 and plan.source == "from --gpu-memory-utilization 0.5"
    with pytest.raises(ConfigError, match="--gpu-memory-utilization 0.3: 0 bytes hold no cache block"):
        kv_cache_plan(EngineConfig(gpu_memory_utilization=0.3), SPEC, runtime(), announce=False)


@pytest.mark.parametrize("options, message", [
    ({"gpu_memory_utilization": 1.5}, "give a fraction in"),
    ({"gpu_memory_utilization": 0.9, "kv_cache_memory": "1GiB"}, "not both"),
])
def test_gpu_memory_utilization_is_checked(options, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**options)


def test_tp_at_load_time_matches_one_process_and_refuses_another_split(tmp_path):
    from llmopt.stages.serve.build import build_engine
    from llmopt.stages.shard.config import ShardConfig
    from llmopt.stages.serve.tp.at_load import artifact_for_tp
    from llmopt.stages.shard.run import run_shard
    from tests.helpers import write_hf_dir

    write_hf_dir(tmp_path / "base", hidden=96, heads=6, kv_heads=2)
    config, greedy = EngineConfig(block_size=4, num_blocks=64, max_num_seqs=2), \
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = []
    for tp in (1, 2):
        engine = build_engine(str(tmp_path / "base"), config, "cpu", torch.float32, "reference",
                              tensor_parallel_size=tp)
        try:
            if tp == 2:
                assert engine.runner.ranks.tp == 2 and "llmopt-tp-" in engine.runner.ranks.path
            outputs.append([o.token_ids for o in engine.generate(["the quick brown fox", "pack it"], greedy)])
        finally:
            if getattr(engine.runner, "ranks", None) is not None:
                engine.runner.ranks.close()
    assert outputs[0] == outputs[1]
    run_shard(str(tmp_path / "base"), tmp_path / "tp2", ShardConfig(2))
    with pytest.raises(ConfigError, match="sharded for 2 ranks"):
        artifact_for_tp(str(tmp_path / "tp2"), 4)
    assert artifact_for_tp(str(tmp_path / "tp2"), 1).path == artifact_for_tp(str(tmp_path / "tp2"), 2).path
    assert artifact_for_tp(str(tmp_path / "base"), 1) is None  # served in this process, as before
