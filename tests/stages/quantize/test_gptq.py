import pytest
import torch

from llmopt.stages.errors import ConfigError
from llmopt.stages.quantize.gptq import HessianAccumulator, gptq_quantize
from llmopt.stages.quantize.rtn import QuantArgs, compute_qparams, dequantize, fake_quantize, quantize


def calib(n, cols, seed):
    """Correlated inputs with uneven channel magnitudes, like a transformer's hidden states."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(cols, cols, generator=gen) / cols ** 0.5 + torch.eye(cols)
    x = torch.randn(n, cols, generator=gen) @ mix  # [n, in]
    return x * torch.exp(torch.randn(cols, generator=gen))  # per-channel magnitudes


def layer(out, cols, seed):
    return torch.randn(out, cols, generator=torch.Generator().manual_seed(seed + 100))


def hessian(x):
    return 2 * x.double().t() @ x.double() / x.shape[0]


def gptq_reference(w, H, args, damp=0.01, act_order=False, mask=None):
    """Plain GPTQ/OBS in float64: one column at a time, the inverse Hessian eliminated row by row."""
    W, H = w.double().clone(), H.double().clone()
    out, n = W.shape
    g = n if args.group_size == -1 else args.group_size
    one = QuantArgs(args.bits, -1, args.symmetric)
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    keep = torch.ones_like(W, dtype=torch.bool) if mask is None else ~mask
    W = W * keep
    static = compute_qparams(W, args) if (act_order or g == n) else None
    perm = torch.argsort(torch.diagonal(H), descending=True) if act_order else torch.arange(n)
    W, H, keep = W[:, perm], H[perm][:, perm], keep[:, perm]
    Hinv = torch.linalg.inv(H + damp * torch.diagonal(H).mean() * torch.eye(n, dtype=H.dtype))
    Q = torch.zeros(out, n, dtype=torch.int8)
    for j in range(n):
        if static is not None:
            grp = int(perm[j]) // g
            s = static[0][:, grp:grp + 1]
            z = None if static[1] is None else static[1][:, grp:grp + 1]
        elif j % g == 0:
            s, z = compute_qparams(W[:, j:j + g], one)
        Q[:, j] = quantize(W[:, j:j + 1], s, z, one)[:, 0]
        deq = dequantize(Q[:, j:j + 1], s, z, one)[:, 0]
        err = (W[:, j] - deq) / Hinv[j, j]
        W[:, j + 1:] -= torch.outer(err, Hinv[j, j + 1:])
        W[:, j + 1:] *= keep[:, j + 1:]
        Hinv -= torch.outer(Hinv[:, j], Hinv[j, :]) / Hinv[j, j]
    return Q[:, torch.argsort(perm)]


CASES = [  # (out, in, args, block_size, act_order)
    (32, 64, QuantArgs(4, 32, True), 128, False),
    (48, 128, QuantArgs(4, 32, False), 64, False),
    (48, 128, QuantArgs(4, -1, True), 32, False),
    (48, 128, QuantArgs(8, 64, True), 16, False),
    (48, 128, QuantArgs(4, 32, True), 32, True),
    (32, 64, QuantArgs(4, 16, False), 32, True),
]


@pytest.mark.parametrize("out,cols,args,block,act_order", CASES)
def test_matches_reference_in_float64(out, cols, args, block, act_order):
    x = calib(256, cols, seed=cols)
    x[:, 5] = 0  # a dead input channel
    w, H = layer(out, cols, seed=out).double(), hessian(x)
    res = gptq_quantize(w, H, args, block_size=block, act_order=act_order)
    ref = gptq_reference(w, H, args, act_order=act_order)
    assert torch.equal(res.q, ref)
    assert torch.equal(res.dequantized, dequantize(res.q, res.scale, res.zero_point, args))
    assert torch.all(res.dequantized[:, 5] == 0)
    assert res.error > 0


@pytest.mark.parametrize("out,cols,args,block,act_order", CASES[:3])
def test_float32_matches_reference_on_nearly_all_weights(out, cols, args, block, act_order):
    x = calib(256, cols, seed=cols + 1)
    w = layer(out, cols, seed=out + 1)
    acc = HessianAccumulator(cols)
    acc.add(x)
    res = gptq_quantize(w, acc.hessian, args, block_size=block, act_order=act_order)
    ref = gptq_reference(w, hessian(x), args, act_order=act_order)
    assert res.q.dtype == torch.int8 and res.scale.dtype == torch.float32
    assert (res.q != ref).float().mean() < 0.01
    ref_deq = dequantize(ref, res.scale.double(), res.zero_point, args)
    assert torch.mean((res.dequantized.double() - ref_deq).abs()) < 1e-3


def output_error(x, w, wq):
    return torch.linalg.norm(x @ w.t() - x @ wq.t()) / torch.linalg.norm(x @ w.t())


@pytest.mark.parametrize("args", [QuantArgs(4, 32, True), QuantArgs(4, 32, False), QuantArgs(4, -1, True)])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_output_error_below_rtn(args, act_order):
    x, w = calib(512, 128, seed=7), layer(48, 128, seed=7)
    acc = HessianAccumulator(128)
    for chunk in x.split(100):
        acc.add(chunk)
    res = gptq_quantize(w, acc.hessian, args, act_order=act_order)
    gptq_err = output_error(x, w, res.dequantized)
    rtn_err = output_error(x, w, fake_quantize(w, args))
    assert gptq_err < 0.85 * rtn_err
    assert res.q.min() >= args.qmin and res.q.max() <= args.qmax


@pytest.mark.parametrize("args", [QuantArgs(4, 16, True), QuantArgs(4, 16, False)])
@pytest.mark.parametrize("act_order", [False, True])
def test_mask_keeps_pruned_weights_at_zero(args, act_order):
    x, w = calib(256, 64, seed=3), layer(32, 64, seed=3)
    mask = torch.rand(w.shape, generator=torch.Generator().manual_seed(0)) < 0.5
    w = w.masked_fill(mask, 0)
    res = gptq_quantize(w, hessian(x).float(), args, block_size=32, act_order=act_order, mask=mask)
    assert torch.all(res.dequantized[mask] == 0)
    assert torch.all(dequantize(res.q, res.scale, res.zero_point, args)[mask] == 0)
    ref = gptq_reference(w.double(), hessian(x), args, act_order=act_order, mask=mask)
    assert (res.q != ref).float().mean() < 0.01


def test_hessian_accumulator_running_mean():
    x = calib(300, 16, seed=1)
    acc = HessianAccumulator(16)
    acc.add(x[:100].bfloat16().float().reshape(4, 25, 16))  # [batch, seq, in]
    acc.add(x[100:].bfloat16())
    assert acc.nsamples == 300 and acc.hessian.dtype == torch.float32
    expect = hessian(x.bfloat16().float()).float()
    assert torch.allclose(acc.hessian, expect, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError):
        acc.add(torch.zeros(3, 8))


def test_bad_dampening_is_a_config_error():
    with pytest.raises(ConfigError, match="dampening"):
        gptq_quantize(torch.randn(4, 8), torch.eye(8), QuantArgs(4, -1), damp=0)


@pytest.mark.parametrize("args", [QuantArgs(4, 32, True), QuantArgs(4, 32, False)])
def test_mse_observer_lowers_gptq_output_error(args):
    # heavy-tailed weights (as in LLMs): min..max groups waste their grid on the tails
    x, w = calib(512, 128, seed=5), layer(48, 128, seed=5)
    w = w * (1 + 4 * (torch.rand(w.shape, generator=torch.Generator().manual_seed(1)) > 0.98))
    acc = HessianAccumulator(128)
    acc.add(x)
    errs = {obs: output_error(x, w, gptq_quantize(w, acc.hessian, args, observer=obs).dequantized)
            for obs in ("minmax", "mse")}
    assert errs["mse"] < errs["minmax"]


def test_linears_reading_one_input_share_one_hessian():
    # q/k/v read one normed input and gate/up another: one accumulator each, fed by one hook, equal to
    # what separate accumulators over the same inputs hold.
    from llmopt.stages.layerwise import input_observer
    from llmopt.stages.quantize.methods import GPTQ
    from tests.helpers import make_model

    model = make_model(100, seed=2, layers=1, hidden=32, heads=4, kv_heads=2)
    layer = model.model.layers[0]
    names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    method = GPTQ({0: {n: QuantArgs(4, 16, True) for n in names}}, damp=0.01, act_order=False, sink_share=0.0,
                  observer="minmax")
    hooks = method.observers(0, layer)
    assert set(hooks) == {"", "self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"}
    h = method.hessians
    assert h["self_attn.q_proj"] is h["self_attn.k_proj"] is h["self_attn.v_proj"]
    assert h["mlp.gate_proj"] is h["mlp.up_proj"] and h["mlp.down_proj"] is not h["mlp.up_proj"]
    seen = {n: HessianAccumulator(layer.get_submodule(n).in_features) for n in ("self_attn.k_proj", "mlp.up_proj")}
    handles = [layer.get_submodule(n).register_forward_pre_hook(input_observer(cb)) for n, cb in hooks.items() if n]
    handles += [layer.get_submodule(n).register_forward_pre_hook(input_observer(acc.add)) for n, acc in seen.items()]
    with torch.no_grad():
        model(input_ids=torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3)))
    for handle in handles:
        handle.remove()
    for name, acc in seen.items():
        assert acc.nsamples == 24 and torch.allclose(h[name].hessian, acc.hessian)
