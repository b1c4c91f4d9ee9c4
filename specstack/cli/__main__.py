from specstack.cli.app import main

raise SystemExit(main())
