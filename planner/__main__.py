import sys

from trainplan.planner.cli.main import main

sys.exit(main())
