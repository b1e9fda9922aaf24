"""The serving engine: paged KV cache with prefix caching, continuous-batching scheduler, and an
async front for the server. Reading order: engine.py -> scheduler.py -> kv_cache.py
(async_engine.py runs it on a thread for the server; cuda_graph.py holds the captured steps)."""

from .async_engine import AsyncEngine
from .engine import EngineRequest, LLMEngine, QueueFullError, RequestOutput, TokenLogprob

__all__ = ["AsyncEngine", "EngineRequest", "LLMEngine", "QueueFullError", "RequestOutput",
           "TokenLogprob"]
