"""What `llmopt inspect` reports, computed from the manifest and safetensors headers only."""
from __future__ import annotations

import json
from pathlib import Path

from .artifact import member_path
from .safetensors_io import tensor_infos, weight_files

# compressed-tensors bookkeeping tensors: not parameters of the model
_PARAM_SKIP = ("weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx")


def summarize(path: Path, manifest: dict | None) -> dict:
    """Parameters and bytes by dtype from the headers; the manifest as stored (None for HF dirs)."""
    path = Path(path)
    files = [n for n in (manifest or {}).get("files", {}) if n.endswith(".safetensors")] or weight_files(path)
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    by_dtype: dict[str, dict] = {}
    params = 0
    for name in files:
        for tname, (dtype, shape, nbytes) in tensor_infos(member_path(path, name, f"{path}: weight file")).items():
            numel = 1
            for d in shape:
                numel *= d
            row = by_dtype.setdefault(dtype, {"tensors": 0, "parameters": 0, "bytes": 0})
            row["tensors"] += 1
            row["bytes"] += nbytes
            if not tname.endswith(_PARAM_SKIP):
                numel *= _values_per_element(tname, config)
                row["parameters"] += numel
                params += numel
    return {
        "path": str(path), "architecture": (config.get("architectures") or ["?"])[0],
        "num_parameters": params, "weight_bytes": sum(v["bytes"] for v in by_dtype.values()),
        "by_dtype": by_dtype, "manifest": manifest,
    }


def _values_per_element(name: str, config: dict) -> int:
    """A packed int32 word holds 32/bits weights (compressed-tensors pack-quantized)."""
    if not name.endswith(".weight_packed"):
        return 1
    from .compressed import parse_schemes

    module = name[: -len(".weight_packed")]
    scheme = parse_schemes(config.get("quantization_config") or {}, [module]).get(module)
    return 32 // scheme.bits if scheme else 1
