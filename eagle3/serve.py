"""`python -m eagle3.serve`: the reference server's command (eagle3.serving.serve), kept at its short name."""

import sys

from eagle3.serving.serve import main

if __name__ == "__main__":
    sys.exit(main())
