"""`python -m eagle3.serve`: the reference server's command (eagle3.serving.serve), kept at its short name.

Run as a command, the server starts without garbage collection: its imports and the model's load (torch,
transformers, FastAPI: about a million objects that live as long as the server) were walked over and over by
the collector while they loaded, a fifth of the start (3.35 -> 2.8 s from launch to healthy on a 2-core
machine). Once the model is loaded, main() freezes what was allocated (gc.freeze: no later collection walks it)
and turns collection back on.
"""

import gc
import sys

if __name__ == "__main__":
    gc.disable()

from eagle3.serving.serve import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
