import sys

from .cli import main

if __name__ == "__main__":  # a spawned child (signoff/apart.py) imports this module too
    sys.exit(main())
