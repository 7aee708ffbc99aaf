"""File digests, as the journal, the injectors and setup record them."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: Path) -> str | None:
    """Hex sha256 of a file's bytes, or None when the file does not exist."""
    try:
        with path.open("rb") as fh:
            return hashlib.file_digest(fh, "sha256").hexdigest()
    except FileNotFoundError:
        return None
