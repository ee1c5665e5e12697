from automp.cli import main

raise SystemExit(main())
