"""``python -m sim roundtrip --ranks 2 --model-mib 64 --bucket-mib 16 --versions 3`` (see sim/cli.py)."""
from .cli import main
from .interrupt import exit_process

if __name__ == "__main__":
    exit_process(main())
