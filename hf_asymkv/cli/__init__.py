"""The `hf-asymkv` command line (:func:`main`); one module per command group, shared flags in :mod:`.args`."""

from .app import main

__all__ = ["main"]
