"""The errors a user is expected to meet: the ``megarl`` command prints them as one line.

A :class:`UserError` says what is wrong with what the user gave (a config key, a checkpoint file, a
layout) and how to fix it; its message is the whole report, so the command line
(:func:`megarl.cli.main`) prints it on one line of stderr and exits non-zero, without a traceback
(``--debug`` or ``MEGARL_DEBUG=1`` prints the traceback too). Any other exception is a bug and keeps
its traceback.

The expected errors derive from this class where they are defined (each module keeps its own
exception): ``ConfigError`` (``megarl.config``), ``CheckpointFileError`` and ``ConfigMismatchError``
(``megarl.conversion``), ``LayoutMismatchError`` (a conversion job's world size), ``PlanError`` (a
weight-sync plan that cannot be built). It subclasses ``ValueError`` so callers that catch that keep
working.
"""
from __future__ import annotations


class UserError(ValueError):
    """An expected error: the message alone tells the user what to change."""

    exit_code = 2
    """The process exit status the ``megarl`` command returns for it."""

    def one_line(self) -> str:
        """The message on one line: continuation lines joined with ``; `` (a ``ConfigError`` lists
        each problem on its own line)."""
        parts = [line.strip().removeprefix("- ").strip() for line in str(self).splitlines()]  # bullets, not `--flag`
        return "; ".join(p for p in parts if p).replace(":;", ":")
