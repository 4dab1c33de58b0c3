"""User-facing errors: the CLI prints their message on one line and exits with status 2."""


class LowbitError(Exception):
    """A problem with the user's input (file, model, option) that we can name clearly."""
