"""llmopt import SOURCE -o DIR: any source -> base artifact."""
from __future__ import annotations

from .options import DType, DTypeOpt, Force, Json, Output, Source
from .ui import err, human_bytes, note, out, print_json


def run(source: Source, output: Output, dtype: DTypeOpt = DType.auto, force: Force = False,
        json: Json = False) -> None:
    from llmopt.stages import source as sources
    from llmopt.stages.artifact import check_destination
    from llmopt.stages.importer import import_source
    from llmopt.stages.model_io import parse_dtype

    src = sources.resolve(source)
    check_destination(output, force)  # before the slow load, so a typo costs nothing
    with err.status(f"importing {source}"):
        art = import_source(src, output, dtype=parse_dtype(dtype.value), force=force, progress=note)
    if json:
        print_json({"path": str(art.path), "content_hash": art.content_hash, "model": art.manifest["model"]})
        return
    model = art.manifest["model"]
    out.print(f"[green]wrote[/green] {art.path}: {model['architecture']}, {model['num_parameters']:,} parameters, "
              f"{model['dtype']}, {human_bytes(art.manifest['metrics']['size_bytes'])} of weights, "
              f"content hash {art.content_hash[:16]}")
