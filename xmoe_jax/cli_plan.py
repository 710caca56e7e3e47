"""`python -m xmoe_jax.cli_plan ...` = `xmoe-plan ...` (the console script without installing it)."""

import sys

from xmoe_jax.cli import plan_main

if __name__ == "__main__":
    sys.exit(plan_main())
