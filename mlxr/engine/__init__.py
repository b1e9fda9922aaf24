"""The serving engine: paged KV cache with prefix caching, scheduler, runner, async loop."""
