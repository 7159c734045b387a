"""`python -m specdec_cli ...`: the `specdec` command."""

import sys

from specdec_cli.main import main

if __name__ == "__main__":
    sys.exit(main())
