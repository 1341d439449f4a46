"""Decode steps replayed from captured graphs give exactly the eager logits and KV cache.

On CPU the graphs are `EagerCapture`'s stand-ins: a replay reruns the recorded forward on the same static
buffers, so everything but the CUDA graph itself (buckets, padding rows, buffer copies, what stays eager)
is checked here. The test at the end captures real CUDA graphs where a GPU is present.
"""
import types

import pytest
import torch

from llmopt.kernels import cpu_native
from llmopt.stages.errors import ConfigError
from llmopt.stages.serve import cuda_graphs
from llmopt.stages.serve.cuda_graphs import DecodeBuffers, EagerCapture, graph_batch_sizes, graphs_apply
from llmopt.stages.serve.engine.config import EngineConfig, SamplingParams
from llmopt.stages.serve.engine.engine import LLMEngine
from llmopt.stages.serve.loader import load_runtime
from llmopt.stages.serve.runner import ModelRunner
from tests.helpers import needs_row_independent_gemm, write_hf_dir
from tests.stages.serve.runner_steps import Sequences

BLOCKS, BLOCK_SIZE = 64, 4
SIZES = [1, 2, 4, 8]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    write_hf_dir(path)
    return path


@pytest.fixture(scope="module")
def runtime(model_dir):
    """A tiny random Llama (2 layers, GQA 4/2) on the exact torch twins, fp32."""
    return load_runtime(str(model_dir), "cpu", torch.float32, backend="reference")[0]


def graphed(runtime, sizes=SIZES) -> tuple[ModelRunner, EagerCapture]:
    runner, capture = ModelRunner(runtime, BLOCKS, BLOCK_SIZE), EagerCapture()
    runner.capture_decode_graphs(sizes, capture)
    return runner, capture


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """n token lists of different lengths (3, 6, 9, ...: the decodes cross block boundaries at different
    steps), each long enough for the prompt and 8 decode tokens."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 300, (3 * (i + 1) + 8,), generator=g).tolist() for i in range(n)]


class Pair:
    """The same sequences, with the same block tables, on an eager runner and on a graphed one."""

    def __init__(self, runtime, n: int, sizes=SIZES, staged: bool = False):
        self.eager, (self.graphed, self.capture) = ModelRunner(runtime, BLOCKS, BLOCK_SIZE), graphed(runtime, sizes)
        if staged:  # assemble steps in host buffers and copy them over, as on CUDA
            graphs = self.graphed.graphs
            graphs.host = DecodeBuffers(graphs.sizes[-1], graphs.width, "cpu")
        self.seqs = [Sequences(BLOCKS, BLOCK_SIZE, seed=1), Sequences(BLOCKS, BLOCK_SIZE, seed=1)]
        for seqs in self.seqs:
            for tokens in prompts(n):
                seqs.add(tokens)

    def step(self, work) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """(eager logits, graphed logits, the bucket the graphed runner replayed or None) for one step."""
        steps = [seqs.step(work) for seqs in self.seqs]
        bucket = self.graphed.graphs.bucket(steps[1])
        replayed = self.capture.replayed
        out = self.eager.execute(steps[0]), self.graphed.execute(steps[1])
        assert self.capture.replayed == replayed + (bucket is not None)
        return *out, bucket

    def prefill(self, ids) -> None:
        eager, graphed, bucket = self.step([(i, len(self.seqs[0].tokens[i]) - 8) for i in ids])
        assert bucket is None and torch.equal(eager, graphed)


def test_batch_sizes():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(1) == [1] and graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert graph_batch_sizes(1000)[-3:] == [240, 248, 256] and graph_batch_sizes(20, limit=10) == [1, 2, 4, 8, 10]


@pytest.mark.parametrize("batch", [1, 2, pytest.param(3, marks=needs_row_independent_gemm), 4,
                                   pytest.param(5, marks=needs_row_independent_gemm), 8])
def test_replay_equals_eager_for_every_bucket(runtime, batch):
    """Logits and the KV cache equal eager mode's bit for bit over 8 decode steps (from lengths 3, 6, 9, ...
    each crosses a block boundary), padded buckets (3 in 4, 5 in 8) included."""
    pair = Pair(runtime, batch)
    pair.prefill(range(batch))
    bucket = next(s for s in SIZES if s >= batch)
    for _ in range(8):
        eager, graphed, used = pair.step([(i, 1) for i in range(batch)])
        assert used == bucket and graphed.shape == (batch, runtime.vocab_size)
        assert torch.equal(eager, graphed)
    assert torch.equal(pair.eager.kv_cache, pair.graphed.kv_cache)  # padding rows wrote nothing


@pytest.mark.interpreted_triton
@needs_row_independent_gemm
def test_triton_kernels_replay_exactly(model_dir):
    """The kernels the CUDA graphs hold (Triton's, interpreted here) take padding rows as the graphs give
    them (slot -1, context length 1): batch 3 in bucket 4, across a block boundary."""
    runtime = load_runtime(str(model_dir), "cpu", torch.float32, backend="triton")[0]
    pair = Pair(runtime, 3, sizes=[1, 4])
    pair.prefill(range(3))
    for _ in range(2):
        eager, graphed, bucket = pair.step([(i, 1) for i in range(3)])
        assert bucket == 4 and torch.equal(eager, graphed)
    assert torch.equal(pair.eager.kv_cache, pair.graphed.kv_cache)


@needs_row_independent_gemm
@pytest.mark.parametrize("staged", [False, True])
def test_padding_rows_are_reset_when_the_batch_shrinks(runtime, staged):
    """4 decodes fill bucket 4, then 3 and 2 sequences replay it: rows left by the earlier steps are padding
    again (a stale slot there would write into another sequence's block). staged: through host buffers."""
    pair = Pair(runtime, 4, staged=staged)
    pair.prefill(range(4))
    for work in ([0, 1, 2, 3], [0, 1, 2, 3], [0, 2, 3], [2, 3], [3, 1, 0], [1, 0, 2, 3]):
        eager, graphed, bucket = pair.step([(i, 1) for i in work])
        assert bucket == (4 if len(work) > 2 else 2) and torch.equal(eager, graphed)
    assert torch.equal(pair.eager.kv_cache, pair.graphed.kv_cache)


def test_capture_writes_nothing_into_the_cache(runtime):
    runner = ModelRunner(runtime, BLOCKS, BLOCK_SIZE)
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=torch.Generator().manual_seed(0)))
    before = runner.kv_cache.clone()
    capture = EagerCapture()
    runner.capture_decode_graphs(SIZES, capture)
    assert capture.captured == len(SIZES) and sorted(runner.graphs.graphs) == SIZES
    assert torch.equal(runner.kv_cache, before)


def test_prefill_mixed_and_large_batches_run_eagerly(runtime):
    pair = Pair(runtime, 4, sizes=[1, 2])
    pair.prefill([0, 1])  # prefill
    eager, graphed, bucket = pair.step([(0, 1), (2, 5)])  # mixed: a decode beside a prefill
    assert bucket is None and torch.equal(eager, graphed)
    pair.prefill([3])
    eager, graphed, bucket = pair.step([(0, 1), (1, 1), (3, 1)])  # 3 decodes: above the largest bucket
    assert bucket is None and torch.equal(eager, graphed)
    eager, graphed, bucket = pair.step([(0, 1), (1, 1)])
    assert bucket == 2 and torch.equal(eager, graphed)
    assert pair.capture.replayed == 1


def test_unfused_execute_runs_eagerly(runtime):
    """`execute(step, fused=False)` (what `llmopt profile` times layer by layer) never replays a graph."""
    pair = Pair(runtime, 2)
    pair.prefill([0, 1])
    step = pair.seqs[1].step([(0, 1), (1, 1)])
    pair.graphed.execute(step, fused=False)
    assert pair.capture.replayed == 0


def test_static_buffers_are_reused(runtime):
    """No step allocates new static inputs or outputs: every replay reads and writes the same memory."""
    pair = Pair(runtime, 3)
    pair.prefill(range(3))
    graphs = pair.graphed.graphs
    inputs = {name: t.data_ptr() for name, t in graphs.static.tensors().items()}
    outputs = [t.data_ptr() for t in graphs.graphs[4].outputs]
    for work in ([0, 1, 2], [0, 1], [0, 1, 2]):
        pair.step([(i, 1) for i in work])
        assert {name: t.data_ptr() for name, t in graphs.static.tensors().items()} == inputs
        assert [t.data_ptr() for t in graphs.graphs[4].outputs] == outputs
    assert graphs.host is graphs.static  # on CPU the step is written straight into the static buffers
    assert pair.capture.captured == len(SIZES)  # nothing was captured again


def engine(model_dir, capture: EagerCapture | None) -> LLMEngine:
    runtime, tokenizer, _ = load_runtime(str(model_dir), "cpu", torch.float32, backend="reference")
    runner = ModelRunner(runtime, 128, BLOCK_SIZE)
    config = EngineConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=32, max_num_seqs=6)
    if capture is not None:
        runner.capture_decode_graphs(graph_batch_sizes(config.seqs_per_step), capture)
    return LLMEngine(runner, tokenizer, config)


def test_engine_greedy_tokens_are_the_same_with_graphs(model_dir):
    """Whole generations through LLMEngine (chunked prefills, mixed steps, batches that shrink as requests
    finish): the same greedy tokens with graphs and without."""
    prompts = ["the quick brown fox", "a language model predicts", "pack the weights, verify the hashes",
               "twelve", "the lazy dog jumps over the quick brown fox and a language model", "write atomically"]
    params = [SamplingParams(temperature=0, max_tokens=6 + 4 * i, ignore_eos=True) for i in range(len(prompts))]

    def run(capture):
        eng = engine(model_dir, capture)
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            eng.add_request(str(i), prompt, p)
        tokens = {}
        while eng.has_unfinished():
            for out in eng.step():
                tokens.setdefault(out.request_id, []).extend(out.token_ids)
        return tokens

    capture = EagerCapture()
    eager, graphed = run(None), run(capture)
    assert graphed == eager and [len(eager[str(i)]) for i in range(len(prompts))] == [6, 10, 14, 18, 22, 26]
    assert capture.replayed >= 15  # most steps were graph replays


def test_graphs_apply_on_cuda_with_triton_only():
    from types import SimpleNamespace

    def rt(device, backend, tp=None, groups=1):
        return SimpleNamespace(device=torch.device(device), backend=SimpleNamespace(name=backend), tp=tp,
                               kv_groups=SimpleNamespace(count=groups))

    assert graphs_apply(rt("cuda", "triton"))
    assert not graphs_apply(rt("cpu", "triton")) and not graphs_apply(rt("cuda", "reference"))
    assert not graphs_apply(rt("cuda", "triton", tp=object()))
    assert not graphs_apply(rt("cuda", "triton", groups=2))  # Gemma 3's local and global layers: eager


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_build_engine_captures_unless_enforce_eager(model_dir, monkeypatch, enforce_eager):
    """build_engine captures one graph per bucket up to the running-batch limit where graphs apply (made to
    apply here, on CPU, with the stand-in capture), and none under --enforce-eager."""
    from llmopt.stages.serve.build import build_engine

    monkeypatch.setattr(cuda_graphs, "graphs_apply", lambda runtime: True)
    monkeypatch.setattr(cuda_graphs, "CudaGraphCapture", EagerCapture)
    config = EngineConfig(num_blocks=64, max_num_seqs=12, max_num_batched_tokens=64, enforce_eager=enforce_eager)
    eng = build_engine(str(model_dir), config, dtype=torch.float32, backend="reference")
    graphs = eng.runner.graphs
    assert (graphs is None) if enforce_eager else (graphs.sizes == [1, 2, 4, 8, 12])


@pytest.mark.parametrize("argv, enforce_eager", [([], False), (["--enforce-eager"], True)])
def test_serve_enforce_eager_reaches_build_engine(model_dir, monkeypatch, argv, enforce_eager):
    import llmopt.stages.serve.build as build
    import llmopt.stages.serve.http.server as server
    from llmopt.cli.main import main

    seen = {}
    def fake_build(source, config, *args, **kw):  # records the engine config; the command then sets the engine's governor
        seen["config"] = config
        return types.SimpleNamespace(thread_governor=None)

    monkeypatch.setattr(build, "build_engine", fake_build)
    monkeypatch.setattr(server, "serve", lambda config, loader, **kw: loader())
    assert main(["serve", str(model_dir), *argv]) == 0
    assert seen["config"].enforce_eager is enforce_eager


@pytest.mark.skipif(not cpu_native.gemv_available(), reason="cpu-native needs the native library and AVX-512")
def test_the_fused_decode_step_is_not_captured(model_dir):
    runtime = load_runtime(str(model_dir), "cpu", torch.float32, backend="cpu-native")[0]
    runner = ModelRunner(runtime, BLOCKS, BLOCK_SIZE)
    if runner.fused_decode is None:
        pytest.skip("no fused decode step for this model here")
    with pytest.raises(ConfigError, match="fused decode"):
        runner.capture_decode_graphs(SIZES, EagerCapture())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_cuda_graphs_match_eager(model_dir):
    """Real CUDA graphs (triton backend, fp32): logits equal eager's exactly where the batch fills its
    bucket and within 1e-5 where it is padded (cuBLAS may pick another kernel for more rows); the caches
    agree the same way."""
    runtime = load_runtime(str(model_dir), "cuda", torch.float32, backend="triton")[0]
    assert graphs_apply(runtime)
    eager, graph = ModelRunner(runtime, BLOCKS, BLOCK_SIZE), ModelRunner(runtime, BLOCKS, BLOCK_SIZE)
    graph.capture_decode_graphs(SIZES)
    seqs = [Sequences(BLOCKS, BLOCK_SIZE, seed=1), Sequences(BLOCKS, BLOCK_SIZE, seed=1)]
    for s in seqs:
        for tokens in prompts(5):
            s.add(tokens)
    for runner, s in zip((eager, graph), seqs):
        runner.execute(s.step([(i, len(s.tokens[i]) - 8) for i in range(5)]))
    for work in ([0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2], [0, 1, 2, 3, 4], [4], [0, 1]):
        steps = [s.step([(i, 1) for i in work]) for s in seqs]
        a, b = eager.execute(steps[0]), graph.execute(steps[1])
        assert graph.graphs.bucket(steps[1]) is not None
        if len(work) in SIZES:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(eager.kv_cache, graph.kv_cache, atol=1e-5, rtol=1e-5)


def test_a_capture_that_fails_leaves_eager_decode_and_one_warning(runtime, caplog):
    """A driver or memory error during capture (never seen yet, but a server must not die of it): one warning
    line, no graphs, and the runner still decodes, eagerly."""
    def failing(forward):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore detail")

    runner = ModelRunner(runtime, BLOCKS, BLOCK_SIZE)
    with caplog.at_level("WARNING", logger="llmopt.serve"):
        assert runner.try_capture_decode_graphs(SIZES, failing) is False
    assert runner.graphs is None
    [record] = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "decoding eagerly" in record.getMessage() and "more detail" not in record.getMessage()
    assert runner.try_capture_decode_graphs(SIZES, EagerCapture()) and runner.graphs.sizes == SIZES
