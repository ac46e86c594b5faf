"""`python -m server serve ...` (the same as the `voicelane` console script)."""

import sys

from server.cli import main

if __name__ == "__main__":
    sys.exit(main())
