"""User-facing errors: the CLI prints their message on one line and exits with code 2."""


class SpecstackError(Exception):
    """Bad input from the user (arguments, files, models): reported without a traceback."""
