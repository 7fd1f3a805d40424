"""`python -m radixserve ...`: the same command line as the `radixserve` script."""
import sys

from radixserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
