"""`UserError`: a user's mistake, found before anything is written; one line, exit code 2. The lowest
layer (imports nothing), so that a table below the config (`schedule_table`) can refuse as the config
does; `hypertrain.config.UserError` is this class.
"""


class UserError(ValueError):
    """A user's mistake (a config value, a command-line argument, a file given that cannot serve), found
    before anything is written or changed: its message is one line naming the value and what would be
    valid; an entry prints it and exits with code 2."""
