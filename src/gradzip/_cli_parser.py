"""The argument parser every ``gradzip`` command line uses: errors on one line."""

from __future__ import annotations

import argparse
import typing

__all__ = ["OneLineParser"]


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``prog: error: ...``, exit 2), pointing
    at ``--help`` instead of printing the whole usage; subcommands inherit it."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} "
                     f"(see {self.prog} --help)\n")
