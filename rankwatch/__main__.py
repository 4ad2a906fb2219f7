from rankwatch.cli import main

raise SystemExit(main())
