"""Token lengths for synthetic prompts: the server's own tokenizer over HTTP, or a local one.

Only the `random` and `shared-prefix` datasets need one (to cut prompts of N tokens). Reported
prompt and output token counts always come from the server's `usage`, never from here.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from tokenmill.bench.datasets import DatasetError


class ServerTokenizer:
    """`POST /tokenize` and `/detokenize` of the server under test. The tokenize body has
    tokenmill/vLLM's field names (`prompt`, `add_special_tokens`), or llama.cpp's (`content`,
    `add_special`) once a server refused those (servers that refuse unknown fields take only
    their own); the answers are read in either shape, so the same workload is cut with each
    server's own tokenizer."""

    def __init__(self, root_url: str, headers: dict[str, str], timeout: float = 60.0):
        self._client = httpx.Client(base_url=root_url, headers=headers, timeout=timeout)
        self._llama_cpp_names = False

    def encode(self, text: str) -> list[int]:
        vllm = {"prompt": text, "add_special_tokens": False}
        llama_cpp = {"content": text, "add_special": False}
        if self._llama_cpp_names:
            body = self._post("/tokenize", llama_cpp)
        else:
            try:
                body = self._post("/tokenize", vllm)
            except DatasetError:
                body = self._post("/tokenize", llama_cpp)
                self._llama_cpp_names = True
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise DatasetError(f"/tokenize answered without a token list: {str(body)[:200]}")
        return [t["id"] if isinstance(t, dict) else int(t) for t in tokens]

    def decode(self, token_ids: list[int]) -> str:
        body = self._post("/detokenize", {"tokens": list(token_ids)})
        text = body.get("prompt", body.get("content"))
        if not isinstance(text, str):
            raise DatasetError(f"/detokenize answered without text: {str(body)[:200]}")
        return text

    def _post(self, path: str, body: dict) -> dict:
        try:
            r = self._client.post(path, json=body)
        except httpx.HTTPError as e:
            raise DatasetError(f"cannot reach {self._client.base_url}{path}: {e}") from None
        if r.status_code != 200:
            raise DatasetError(f"{path} answered {r.status_code} ({r.text[:200]}); this dataset needs the "
                               "server's tokenizer endpoints or --tokenizer PATH")
        return r.json()

    def close(self) -> None:
        self._client.close()


class HFTokenizer:
    """A Hugging Face tokenizer from a directory, a hub-style name already in the local cache, or a
    .gguf file (transformers reads the tokenizer from the GGUF metadata)."""

    def __init__(self, name_or_path: str):
        from transformers import AutoTokenizer

        path = Path(name_or_path)
        if path.suffix == ".gguf":
            self._tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        else:
            self._tok = AutoTokenizer.from_pretrained(name_or_path)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids)

    def close(self) -> None:
        pass
