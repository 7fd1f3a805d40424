"""`python -m radixserve ...`: the same command line as the `radixserve` script."""
from radixserve.cli import entry

if __name__ == "__main__":
    entry()
