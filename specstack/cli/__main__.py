"""`python -m specstack.cli`: the `specstack` command."""
from specstack.cli.entry import main

raise SystemExit(main())
