"""`python -m trainer2 [command] [flags]`: the same command line as the `trainer2` script and `python main.py`."""

import sys

from trainer2.cli import main

if __name__ == "__main__":
    sys.exit(main())
