"""`llmopt serve SOURCE --tensor-parallel-size N` (vLLM's `-tp N`): split an unsharded source at load time.

The offline sharder (`llmopt shard`) writes the ranks' folders into a temporary directory, which the
ranks then load as they load any sharded artifact; the directory goes when the process exits. Sharding
reads the source memory-mapped, a layer at a time, so this costs about the source's size on disk
(under $TMPDIR) and seconds of start-up; `llmopt shard` once keeps that for reuse.
"""
from __future__ import annotations

import atexit
import logging
import shutil
import tempfile
from pathlib import Path

from ...errors import ConfigError

log = logging.getLogger("llmopt.serve")


def artifact_for_tp(ref: str, tp: int):
    """The sharded artifact to serve `ref` on `tp` ranks: `ref`'s own when it is sharded (its rank count
    must then be `tp`, or `tp` 1: not given), else one split now into a temporary directory; None for
    `tp` 1 and an unsharded source (served in this process)."""
    from ...shard.config import ShardConfig
    from ...shard.run import run_shard
    from ..loader import sharded_artifact

    art = sharded_artifact(ref)
    if art is not None:
        ranks = art.tensor_parallel["tp"]
        if tp not in (1, ranks):
            raise ConfigError(f"--tensor-parallel-size {tp}: {ref} is sharded for {ranks} ranks; serve it with "
                              f"-tp {ranks}, or shard its parent again")
        return art
    if tp == 1:
        return None
    folder = Path(tempfile.mkdtemp(prefix="llmopt-tp-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    log.info("sharding %s for %d ranks into %s (llmopt shard --tp %d keeps it)", ref, tp, folder, tp)
    try:
        return run_shard(ref, folder / "model", ShardConfig(tp))
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
