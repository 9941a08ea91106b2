from ddplab.cli.main import main

raise SystemExit(main())
