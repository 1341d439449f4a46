"""ServerState: the engine (once loaded), the HTTP side's tokenizer, admission and metrics."""
from __future__ import annotations

import logging
from collections import Counter

from ..engine.async_engine import AsyncEngine
from .admission import Admission
from .config import ServerConfig
from .errors import APIError, engine_dead
from .metrics import Scrape, ServerMetrics
from .quota import Quotas

log = logging.getLogger("llmopt.serve")


class ServerState:
    """What the routes share: config, metrics, and once loaded the engine and its admission."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.metrics = ServerMetrics(config.served_model_name, self.scrape)
        self.engine: AsyncEngine | None = None
        self.admission: Admission | None = None
        self.quotas = Quotas(config.tenants, config.retry_after_s)  # per-tenant limits (--api-keys-file)
        self.load_error: BaseException | None = None
        self.draining = False
        self.fatal: BaseException | None = None  # a tensor-parallel rank died: the server is stopping
        self.loader = None  # the thread loading the model, when the app loads it
        self.in_flight: set = set()  # the Generations submitted and not yet closed
        self.refused: Counter[str] = Counter()  # 503s given before admission (draining, too many connections)
        self.cache_config: dict[str, str] = {}  # cache_config_info's labels, once loaded
        self.startup = None  # the process's StartupReport when the app loads the model (serve/startup.py)
        self.grpc_port: int | None = None  # the gRPC API's bound port, once it serves (stages/serve/rpc)

    def attach(self, llm_engine) -> None:
        """Serve `llm_engine` (an LLMEngine): start its loop thread and open the API."""
        engine = AsyncEngine(llm_engine)
        self.admission = Admission(self.config, engine)
        self.cache_config = self._cache_config(llm_engine)
        self.engine = engine

    @property
    def tokenizer(self):
        """The event loop's tokenizer (the engine's loop thread has one of its own)."""
        return self.engine.tokenizer if self.engine is not None else None

    @property
    def max_model_len(self) -> int | None:
        return self.engine.config.max_model_len if self.engine is not None else None

    @property
    def healthy(self) -> bool:
        return self.engine is not None and self.engine.is_healthy and not self.draining and self.fatal is None

    def ready_engine(self) -> AsyncEngine:
        """The running engine, or 503: shutting down, still loading, failed to load, or dead."""
        if self.draining:
            self.refused["draining"] += 1
            raise APIError(503, "the server is shutting down; retry on another replica", code="draining",
                           headers={"Retry-After": str(self.config.retry_after_s), "Connection": "close"})
        if self.engine is None:
            if self.load_error is not None:
                raise APIError(503, f"the model failed to load: {self.load_error}", code="load_failed")
            raise APIError(503, "the model is still loading; retry shortly", code="loading",
                           headers={"Retry-After": str(self.config.retry_after_s)})
        if self.fatal is not None:
            raise engine_dead(self.fatal)
        if not self.engine.is_healthy:
            raise engine_dead(self.engine.error or RuntimeError("shut down"))
        return self.engine

    def stats(self):
        return self.engine.stats() if self.engine is not None else None

    def scrape(self) -> Scrape:
        """What /metrics reads beside the HTTP side's own series."""
        return Scrape(self.stats(), self.rejected(), self.healthy, self.cache_config, self.quotas.snapshot())

    @staticmethod
    def _cache_config(llm_engine) -> dict[str, str]:
        """The KV cache's settings (vLLM's cache_config_info labels where they mean the same)."""
        config, dtype = llm_engine.config, getattr(llm_engine.runner, "kv_dtype", None)
        return {"block_size": str(config.block_size), "num_blocks": str(config.num_blocks),
                "cache_dtype": str(dtype).removeprefix("torch.") if dtype is not None else "auto",
                "enable_prefix_caching": str(config.enable_prefix_caching)}

    def rejected(self) -> Counter[str]:
        """Every 503 refusal by its code, admission's and the server's own."""
        return (self.admission.rejected if self.admission is not None else Counter()) + self.refused

    def abort_in_flight(self) -> int:
        """At the end of the drain: abort every request still running. A stream ends with a last chunk
        whose finish_reason is "abort" and [DONE], a whole response is 503. One log line each."""
        aborted = list(self.in_flight)
        for generation in aborted:
            log.warning("aborted %s (request id %s): still running when the drain timeout (%g s) ran out",
                        generation.request_id, generation.access_id or "-", self.config.drain_timeout_s)
            generation.shut_down()
        return len(aborted)

    def shutdown(self) -> None:
        """Stop the engine after its current step (again harmless)."""
        if self.engine is not None:
            self.engine.shutdown(timeout=2.0 if self.fatal is not None else 30.0)

    def finish(self) -> None:
        """After the server has stopped: let a load still under way end (a process that exits under a
        thread inside torch can abort, and an import may be mid-write), then stop the engine."""
        if self.loader is not None and self.loader.is_alive():
            log.info("waiting for the model load to finish before exiting")
            self.loader.join()
        self.shutdown()
