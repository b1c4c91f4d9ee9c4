"""`python -m specstack.cli`: the `specstack` command."""
from specstack.cli import main

raise SystemExit(main())
