from rematc.cli import main

raise SystemExit(main())
