"""Errors a user can act on. Their message is one line naming the file and the problem."""


class ApplianceError(Exception):
    """Base class: the CLI prints str(error) on one line and exits non-zero."""


class ModelLoadError(ApplianceError):
    """A model directory that cannot be loaded: missing file, corrupt tensor, unknown model type."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class ContextLengthError(ApplianceError, ValueError):
    """A prompt that does not fit in the context window."""

    def __init__(self, prompt_tokens: int, max_context: int):
        self.prompt_tokens = prompt_tokens
        self.max_context = max_context
        super().__init__(f"the prompt has {prompt_tokens} tokens but the context holds at most "
                         f"{max_context} (prompt plus at least one generated token)")


class KVCacheFullError(ApplianceError):
    """No free KV blocks left for a new or growing sequence."""
