"""The command line: one module per command (DESIGN §1: the top layer); app.py wires them, entry.py is
the `specstack` command itself (imports nothing here, so the package and its modules form no circle)."""
