"""tokenmill: an LLM inference server with in-flight batching over a paged KV cache.

`LLM` is imported lazily so that the torch-free `tokenmill.core` can be used without torch.
"""

from tokenmill.sampling_params import SamplingParams
from tokenmill.version import __version__

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from tokenmill.entrypoints.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from tokenmill import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
