"""Tiny random Llamas quantized once per session for the export tests (RTN: no calibration, about a second each)."""
import pytest

from tests.helpers import write_chat_model_dir, write_hf_dir

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>{% endfor %}"
# name -> (source, QuantizeConfig fields); every artifact stores its scales in the dtype it is quantized in
ARTIFACTS = {
    "w4_bf16": ("tied", dict(scheme="W4A16", group_size=32, dtype="bf16", embeddings="int8")),  # int8 embedding g32
    "w4_fp16": ("untied", dict(scheme="W4A16", group_size=32, dtype="fp16", embeddings="keep")),
    "w8_fp16": ("chat", dict(scheme="W8A16", group_size=32, dtype="fp16", embeddings="keep")),
    "w8_bf16": ("tied", dict(scheme="W8A16", group_size=32, dtype="bf16", embeddings="keep")),
    "w4_auto": ("tied", dict(scheme="W4A16", dtype="bf16", embeddings="keep")),  # down_proj gets group 64
    "w4_fp32": ("tied", dict(scheme="W4A16", group_size=32, embeddings="keep")),  # fp32 scales
    "w4_asym": ("tied", dict(scheme="W4A16", group_size=32, dtype="bf16", symmetric=False, embeddings="keep")),
    "w8a8": ("tied", dict(scheme="W8A8", dtype="bf16", embeddings="keep")),
}


@pytest.fixture(scope="session")
def tiny_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("export-src")
    write_hf_dir(root / "tied")
    write_hf_dir(root / "untied", seed=1, tie=False)
    write_chat_model_dir(root / "chat", CHAT_TEMPLATE)
    return root


@pytest.fixture(scope="session")
def quantized(tiny_sources, tmp_path_factory):
    """quantized(name) -> the artifact directory of ARTIFACTS[name], made on first use."""
    from llmopt.stages.quantize.config import QuantizeConfig
    from llmopt.stages.quantize.run import run_quantize

    root, made = tmp_path_factory.mktemp("export-art"), {}

    def get(name: str):
        if name not in made:
            source, fields = ARTIFACTS[name]
            config = QuantizeConfig(method="rtn", eval_windows=0, **fields)
            made[name] = run_quantize(str(tiny_sources / source), root / name, config).path
        return made[name]

    return get
