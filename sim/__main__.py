"""``python -m sim roundtrip --ranks 2 --model-mib 64 --bucket-mib 16 --versions 3`` (see sim/cli.py)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
