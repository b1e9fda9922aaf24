"""The serving engine: paged KV cache with prefix caching, continuous-batching scheduler, and an
async front for the server. Reading order: engine.py -> scheduler.py -> kv_cache.py."""

from .engine import (AsyncEngine, EngineRequest, LLMEngine, QueueFullError, RequestOutput,
                     TokenLogprob)

__all__ = ["AsyncEngine", "EngineRequest", "LLMEngine", "QueueFullError", "RequestOutput",
           "TokenLogprob"]
