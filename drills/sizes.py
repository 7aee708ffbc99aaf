"""Sizes as scenario authors write them ("256MiB", "1.5GiB", or bytes), finite and bounded.

Pydantic's ``ByteSize`` parses the units; on its own it takes any integer, so a 400-digit size was a
number no filesystem, allocation or comparison could use. :data:`MAX_SIZE_BYTES` bounds it far above
any machine kvdrill drills on.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import ByteSize, Field

MAX_SIZE_BYTES = 1 << 50  # 1 PiB

Size = Annotated[ByteSize, Field(ge=0, le=MAX_SIZE_BYTES)]
