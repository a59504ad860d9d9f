"""The engine: prefill and batched decode over a paged KV cache, sampling, tokenizer, step stats.

It knows nothing of HTTP or telemetry (tests/test_boundaries.py): it emits plain stats objects
(appliance.engine.stats) that the server's exporter turns into series.

    from appliance.engine import Engine

Names load on first use, so that a light submodule (options, batch, stats) can be imported
without the model families and the compiled kernels.
"""
_EXPORTS = {
    "Engine": "appliance.engine.engine", "Sequence": "appliance.engine.engine",
    "TokenEvent": "appliance.engine.engine", "DEMO_MODEL_DIR": "appliance.engine.engine",
    "ContextLengthError": "appliance.errors", "KVCacheFullError": "appliance.errors",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'appliance.engine' has no attribute {name!r}")
