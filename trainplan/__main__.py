"""`python -m trainplan ...`: the `trainplan` command (`trainplan.planner.cli.main.main`), e.g. under
`torchrun ... -m trainplan run PLAN --out DIR`."""

import sys

from trainplan.planner.cli.main import main

sys.exit(main())
