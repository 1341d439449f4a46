"""Column/row parallel wrappers: a world of one, and two gloo ranks against the unsharded MLP."""
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from llmopt.kernels import ColumnParallelLinear, RowParallelLinear, select_backend, shard
from tests.kernels.helpers import quantize_int4, quantize_int8

K, INTER = 128, 64


def _weights():
    g = torch.Generator().manual_seed(0)
    up = quantize_int4(torch.randn(INTER, K, generator=g), 32, True)
    down = quantize_int8(torch.randn(K, INTER, generator=g))
    return up, down, torch.randn(K, generator=g), torch.randn(3, K, generator=g)


def _mlp(weights, rank, world, group):
    up, down, bias, _ = weights
    up = {"weight_packed": shard(up["weight_packed"], 0, rank, world),  # column parallel: split N
          "weight_scale": shard(up["weight_scale"], 0, rank, world), "weight_shape": torch.tensor([INTER // world, K])}
    down = {"weight": shard(down["weight"], 1, rank, world), "weight_scale": down["weight_scale"]}  # row: split K
    cpu = select_backend("cpu-torch")  # torch's int4 / int8 CPU kernels inside the wrappers
    col = ColumnParallelLinear(cpu.quantized_linear("w4a16", up, 32), group)
    row = RowParallelLinear(cpu.quantized_linear("w8a16", down), group, bias=bias)
    return lambda x: row(torch.relu(col(x)))


def _worker(rank, world, weights, init_file, out_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        y = _mlp(weights, rank, world, dist.group.WORLD)(weights[3])
        gather = ColumnParallelLinear(nn.Identity(), dist.group.WORLD, gather_output=True)
        gathered = gather(torch.full((1, 2), float(rank)))
        if rank == 0:
            torch.save({"y": y, "gathered": gathered}, out_file)
    finally:
        dist.destroy_process_group()


def test_world_of_one_is_the_plain_layer():
    weights = _weights()
    y = _mlp(weights, 0, 1, None)(weights[3])
    up, down, bias, x = weights
    cpu = select_backend("cpu-torch")
    dense_up = cpu.quantized_linear("w4a16", up, 32)
    dense_down = cpu.quantized_linear("w8a16", down, bias=bias)
    torch.testing.assert_close(y, dense_down(torch.relu(dense_up(x))))


def test_row_parallel_refuses_inner_bias():
    import pytest

    with pytest.raises(ValueError, match="bias"):
        RowParallelLinear(nn.Linear(4, 4, bias=True))


def test_two_gloo_ranks_match_one(tmp_path):
    weights = _weights()  # built here: the workers then need not import compressed-tensors
    mp.spawn(_worker, args=(2, weights, str(tmp_path / "rdzv"), str(tmp_path / "out.pt")), nprocs=2, join=True)
    result = torch.load(tmp_path / "out.pt")
    expected = _mlp(weights, 0, 1, None)(weights[3])
    # Each rank's partial sum is rounded to bf16 by the CPU kernel before the reduction.
    torch.testing.assert_close(result["y"], expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
    torch.testing.assert_close(result["gathered"], torch.tensor([[0.0, 0.0, 1.0, 1.0]]))
