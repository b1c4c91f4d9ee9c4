"""The `specstack` command: app.main behind the Ctrl-C handling of its own imports."""
from collections.abc import Sequence

from specstack import interrupt

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """The `specstack` command (app.main); the commands are imported only once Ctrl-C is handled, so a
    Ctrl-C while they load ends as quietly as one later (exit 130, no traceback)."""
    with interrupt.handling_sigint():
        try:
            from specstack.cli.app import main as run
        except KeyboardInterrupt:  # not from the handler: a second Ctrl-C while importing
            return 130
        return run(argv)
