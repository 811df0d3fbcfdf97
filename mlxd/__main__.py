from mlxd.cli import main

raise SystemExit(main())
