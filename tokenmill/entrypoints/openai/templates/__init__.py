"""Chat templates shipped with tokenmill, chosen by name: `--chat-template hermes`.

`hermes`: Hermes-style tool calls (`<tool_call>` blocks, what tool_calls.py parses) in ChatML,
Qwen2.5's template. The server also renders requests with tools through it, unasked, when the
model's own template ignores tools but renders conversations as this one does (chat.py).

Kept free of heavy imports: the command-line parser lists the names for `--help`.
"""

from __future__ import annotations

from pathlib import Path

TEMPLATES_DIR = Path(__file__).resolve().parent
TOOLS_TEMPLATE = "hermes"  # the one used for tools when the model's own template ignores them


def template_names() -> list[str]:
    return sorted(path.stem for path in TEMPLATES_DIR.glob("*.jinja"))


def template_path(name_or_file: str) -> Path:
    """A shipped template's file for its name; anything else is taken as a file path (a file
    that happens to be named like a shipped template is reached as `./hermes`)."""
    if name_or_file in template_names():
        return TEMPLATES_DIR / f"{name_or_file}.jinja"
    return Path(name_or_file)


def read_template(name_or_file: str) -> str:
    return template_path(name_or_file).read_text()
