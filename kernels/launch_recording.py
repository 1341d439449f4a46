"""Recording Triton launches on a simulated GPU, without one: what `compile_check` compiles.

Inside `record_launches`, tensors made on "cuda" are fake (shapes, strides, no data: torch's FakeTensorMode) and
`torch.cuda.get_device_properties` answers for a simulated card (`GPUS`), so a public op takes exactly the path it
takes on that GPU, down to its launcher's choices (tile sizes, split-K from the SM count). The launch itself
records a `Launch` (kernel, argument types, the ints it passes, constexprs, launch options) instead of running.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode


@dataclass(frozen=True)
class SimulatedGPU:
    """What a launcher may read of a GPU (the fields of `torch.cuda.get_device_properties` that we simulate)."""

    name: str
    major: int
    minor: int
    multi_processor_count: int
    shared_memory_per_block_optin: int  # bytes of shared memory one program may use: Triton's OutOfResources limit
    total_memory: int
    warp_size: int = 32


GPUS = {
    90: SimulatedGPU("NVIDIA H100 80GB HBM3", 9, 0, 132, 232448, 80 * 2**30),
    80: SimulatedGPU("NVIDIA A100-SXM4-80GB", 8, 0, 108, 166912, 80 * 2**30),
}


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument as the JIT sees it: its element type and whether its address is 16-byte aligned."""

    dtype: torch.dtype
    aligned: bool

    def data_ptr(self) -> int:
        return 0 if self.aligned else 8


@dataclass(frozen=True)
class Launch:
    """One recorded launch: the kernel ("module:name"), its arguments (tensors as `TensorArg`) and the op call
    that made it (for messages)."""

    kernel: str
    args: tuple
    kwargs: tuple  # ((name, value), ...)
    source: str = ""

    @property
    def name(self) -> str:
        return self.kernel.rsplit(":", 1)[1]


def _abstract(value):
    if isinstance(value, torch.Tensor):
        # CUDA allocations are 256-byte aligned: a view is aligned when its offset is.
        return TensorArg(value.dtype, value.storage_offset() * value.element_size() % 16 == 0)
    return value


@contextlib.contextmanager
def _simulated_cuda(gpu: SimulatedGPU):
    """`torch.cuda`'s device queries answer for `gpu` (launchers read the SM count, say, to split work)."""
    from .wq_gemv import device_sm_count

    saved = torch.cuda.get_device_properties, torch.cuda.get_device_capability
    torch.cuda.get_device_properties = lambda device=None: gpu
    torch.cuda.get_device_capability = lambda device=None: (gpu.major, gpu.minor)
    device_sm_count.cache_clear()  # what launchers remember of the real card (or the last simulated one)
    try:
        yield
    finally:
        torch.cuda.get_device_properties, torch.cuda.get_device_capability = saved
        device_sm_count.cache_clear()


class _MetaFallback(TorchFunctionMode):
    """Run on meta twins what cannot run on fake CUDA tensors in a torch built without CUDA: the Python-level
    methods that set a CUDA device guard before dispatching (indexing, `.contiguous()` of a strided view), which
    fail without a CUDA device. The results are fake CUDA tensors with the same sizes, strides and offsets."""

    def __init__(self, fake_mode):
        super().__init__()
        self.fake_mode = fake_mode

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
        from torch.utils._pytree import tree_leaves, tree_map

        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except RuntimeError as error:  # CPU-only torch: "not linked with support for cuda"; CUDA hidden: no device
            if not any(isinstance(t, FakeTensor) and t.is_cuda for t in tree_leaves((args, kwargs))):
                raise
            failed = error

        def to_meta(t):
            if isinstance(t, FakeTensor) and t.is_cuda:
                storage = torch.empty(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype, device="meta")
                return storage.as_strided(t.size(), t.stride(), t.storage_offset())
            return torch.device("meta") if isinstance(t, torch.device) and t.type == "cuda" else t

        def to_cuda(t):
            meta = isinstance(t, torch.Tensor) and t.device.type == "meta"
            return FakeTensor(self.fake_mode, t, torch.device("cuda", 0)) if meta else t

        try:
            with unset_fake_temporarily():
                out = func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
        except Exception:
            raise failed from None  # not a device guard's doing: say what failed on the fake tensors
        return tree_map(to_cuda, out)


class Recording(list):
    """The launches recorded so far, in order; `source` is stored with the ones that follow (what made them)."""

    source = ""


@contextlib.contextmanager
def record_launches(gpu: SimulatedGPU = GPUS[90]):
    """Inside: tensors made on "cuda" are fake (no data, nothing runs) on the simulated `gpu`, and each Triton
    launch appends a `Launch` to the yielded `Recording` instead of running."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ._backend import recording

    launches = Recording()

    def record(fn, grid, args, kwargs):
        kw = tuple((k, _abstract(v)) for k, v in kwargs.items())
        launches.append(Launch(f"{fn.__module__}:{fn.__name__}", tuple(map(_abstract, args)), kw, launches.source))

    with _simulated_cuda(gpu), FakeTensorMode() as fake, _MetaFallback(fake), recording(record):
        yield launches
