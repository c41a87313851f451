"""The ``zkernel`` command (`main`) and the demo (`demo`)."""

from zkernel.cli.commands import main

__all__ = ["main"]
