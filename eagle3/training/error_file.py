"""The error file a training rank leaves torchrun when it raises, whole or not at all.

torch's own handler (`@record`) opens the file torchrun names and writes the JSON into it. A rank
whose peer was killed raises ("Connection reset by peer") at about the moment torchrun SIGTERMs
the ranks still running; stopped between the open and the write, it leaves an empty file. torchrun
then dies parsing it while building its failure report ("Failed to parse reply file"), so the
report that names the killed rank is never printed, and describe_rank_failures names the rank
that only lost its peer. Written beside the file and renamed into place, it is whole or absent.
"""

from __future__ import annotations

import os

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

PARTIAL_SUFFIX = ".partial"


class WholeErrorFile(ErrorHandler):
    """torch's ErrorHandler, with record_exception writing `<error file>.partial` and renaming it."""

    def __init__(self) -> None:
        self._writing = False

    def _get_error_file_path(self) -> str | None:
        path = super()._get_error_file_path()
        return path + PARTIAL_SUFFIX if path and self._writing else path

    def record_exception(self, e: BaseException) -> None:
        self._writing = True
        try:
            super().record_exception(e)
            partial = self._get_error_file_path()
        finally:
            self._writing = False
        if partial and os.path.exists(partial):
            os.replace(partial, partial.removesuffix(PARTIAL_SUFFIX))
