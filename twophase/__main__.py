from twophase.cli import main

raise SystemExit(main())
