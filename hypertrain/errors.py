"""`UserError`: a user's mistake, found before anything is written; one line, exit code 2. The lowest
layer (imports nothing of hypertrain), so that a table below the config (`schedule_table`) can refuse as
the config does; `hypertrain.config.UserError` is this class. `Parser`: a command line whose mistakes
are UserErrors.
"""

from __future__ import annotations

import argparse


class UserError(ValueError):
    """A user's mistake (a config value, a command-line argument, a file given that cannot serve), found
    before anything is written or changed: its message is one line naming the value and what would be
    valid; an entry prints it and exits with code 2."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose mistakes are a UserError, one line ending in `valid` (the command's valid
    form), not argparse's usage block and exit."""

    def __init__(self, *args, valid: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.valid = valid

    def error(self, message: str) -> None:
        raise UserError(f"{message}; {self.valid}")
