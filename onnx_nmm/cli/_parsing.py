"""How `onnx-nmm` reads its flags: a usage error is one line, and a flag's former name still works.

A usage error names what is wrong and stops there: an invalid choice lists the choices ("onnx-nmm rewrite:
error: --method must be one of svd, whiten, fisher, nystrom (got pca)"); any other error points at the
command's --help instead of printing its whole usage block.

A renamed flag keeps its old spelling as a hidden alias, so that scripts do not break: given, it sets the
same option and says in one line (a FutureWarning, on stderr) what the flag is called now.
"""

from __future__ import annotations

import argparse
import warnings
from typing import NoReturn


class OldFlagName(FutureWarning):
    """A flag was given by a name it no longer has; the message is the whole line to print."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr (exit code 2)."""

    def _check_value(self, action: argparse.Action, value) -> None:
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(str, action.choices))
            self.choice_error = True
            raise argparse.ArgumentError(None, f"{flag_name(action)} must be one of {choices} (got {value})")

    def error(self, message: str) -> NoReturn:
        hint = "" if getattr(self, "choice_error", False) else f" (`{self.prog} --help` lists its flags)"
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")


def flag_name(action: argparse.Action) -> str:
    """How a user spells the argument: its longest flag, or its placeholder ("COMMAND") when positional."""
    if action.option_strings:
        return max(action.option_strings, key=len)
    return action.metavar if isinstance(action.metavar, str) else action.dest


class _FormerName(argparse.Action):
    """The old spelling of `current`: says it was renamed, then does what `current` does."""

    def __init__(self, option_strings, dest, current: argparse.Action, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.current = current

    def __call__(self, parser, namespace, values, option_string=None):
        warnings.warn(f"{parser.prog}: note: {option_string} is now {flag_name(self.current)}; the old name still "
                      "works", OldFlagName, stacklevel=2)
        self.current(parser, namespace, values, option_string)


def add_former_name(group, old: str, current: argparse.Action) -> None:
    """Let `old` keep working as `current`'s flag, hidden from --help (the current flag's help names it)."""
    group.add_argument(old, action=_FormerName, current=current, dest=current.dest, type=current.type,
                       nargs=current.nargs, choices=current.choices, metavar=current.metavar,
                       default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def format_warning(prog: str):
    """warnings.formatwarning for the command `prog`: a renamed flag's note as it is, anything else as
    "onnx-nmm rewrite: warning: …"."""

    def formatted(message, category, *_, **__) -> str:
        if issubclass(category, OldFlagName):
            return f"{message}\n"
        return f"{prog}: warning: {message}\n"

    return formatted
