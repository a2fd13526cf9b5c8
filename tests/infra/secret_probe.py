"""A flow the Secret-block test deploys: it records a digest of what its process sees in an env variable."""

import hashlib
import os
from pathlib import Path

from prefect import flow


@flow(name="eagleops-secret-probe")
def secret_probe(names: list[str], out_file: str) -> None:
    seen = {name: hashlib.sha256(os.environ[name].encode()).hexdigest() if name in os.environ else None
            for name in names}
    Path(out_file).write_text("\n".join(f"{name} {digest}" for name, digest in seen.items()))
