"""The package version (a leaf module: the CLI and the package root read it)."""

__version__ = "0.1.0"
