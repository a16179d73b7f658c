"""tokenmill's version (pyproject.toml holds the same), in a module of its own so that any module
may read it without importing the package's public API."""

__version__ = "0.1.0"
