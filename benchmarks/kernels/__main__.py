"""`python -m benchmarks.kernels`: see benchmarks/kernels/__init__.py and `--help`."""
import sys

from benchmarks.kernels.runner import main
from records.exits import run_main

if __name__ == "__main__":
    sys.exit(run_main(main, kinds=('kernel',)))
