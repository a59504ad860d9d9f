"""Edge LLM appliance: Qwen3 on int8 CPU kernels.

    from appliance import Engine
    engine = Engine.load("path/to/Qwen3-0.6B", weights="q8", kv="q8")
"""
__version__ = "0.1.0"


def __getattr__(name):
    # Imported lazily so that `import appliance` (the CLI's --help, the server's
    # config checks) works before the kernels are loaded.
    if name == "Engine":
        from appliance.engine.engine import Engine
        return Engine
    raise AttributeError(name)
