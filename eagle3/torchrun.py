"""`python -m eagle3.torchrun`: the node launcher's command (eagle3.training.torchrun), kept at its short
name; importable without torch, as a node launcher needs no CUDA."""

import sys

from eagle3.training.torchrun import main

if __name__ == "__main__":
    sys.exit(main())
