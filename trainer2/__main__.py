"""`python -m trainer2 [command] [flags]`: the same command line as the `trainer2` script and `python main.py`."""

import sys

try:
    from trainer2.cli import main
except KeyboardInterrupt:  # Ctrl-C while torch loads: nothing started yet, so nothing to save
    sys.stderr.write("trainer2: interrupted\n")
    sys.exit(130)

if __name__ == "__main__":
    sys.exit(main())
