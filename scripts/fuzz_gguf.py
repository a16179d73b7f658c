#!/usr/bin/env python
"""Fuzz the GGUF loader for longer than the suite does: the hypothesis search of
tests/reliability/test_model_files.py (bytes of a GGUF's header, metadata and tensor index
overwritten; every load must work or raise ModelLoadError within a second and 256 MiB) with
--examples examples, plus the truncation and count cases.

    python scripts/fuzz_gguf.py --examples 20000
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=5000, help="corrupted files to try (default: 5000)")
    args = parser.parse_args()
    env = dict(os.environ, TOKENMILL_FUZZ_EXAMPLES=str(args.examples))
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/reliability/test_model_files.py", "--hypothesis-show-statistics"], cwd=ROOT, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
