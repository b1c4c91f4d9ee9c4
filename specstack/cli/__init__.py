"""The command line: one module per command (DESIGN §1: the top layer); app.py wires them."""
from specstack.cli.app import main

__all__ = ["main"]
