from modeldock.cli import main

raise SystemExit(main())
