"""The package version, in a module of its own so that the core and the tools read it without a cycle."""

__version__ = "0.2.0.dev0"
