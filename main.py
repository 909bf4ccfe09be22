"""Entry point: `python main.py [command] [flags]`; see `python main.py --help`."""

import sys

from trainer2.cli import main

if __name__ == "__main__":
    sys.exit(main())
