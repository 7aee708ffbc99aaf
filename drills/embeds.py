"""A prompt given as embeddings: vLLM's ``prompt_embeds`` (base64 of a ``torch.save``d float tensor,
tokens x hidden), read for its shape without torch.

Why not ``torch.load``: kvdrill's own environment does not carry torch (the engine's does), and a prompts file
is data, never code, so the pickle inside the archive is read by a restricted unpickler that knows only the
names a saved plain tensor uses (``torch._utils._rebuild_tensor_v2``, the typed storages, ``OrderedDict``)
and builds nothing but the shape and dtype; any other name is refused, as ``torch.load(weights_only=True)``
refuses it. The bytes sent to the engine are the user's, unchanged.

What the engine does with them (vLLM 0.32, ``--enable-prompt-embeds``): the request's token ids are
placeholders, one 0 per row, which is what a KV connector sees and keys by; ``Prompt.token_ids`` holds the same
placeholders so chunk targeting finds the chunks LMCache stored.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import pickle
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_EMBEDS_BYTES = 32 * 1024 * 1024  # one prompt's tensor, decoded

# torch's storage class names -> the dtype they hold; only floating ones are prompt embeddings
_STORAGES = {"FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
             "DoubleStorage": "float64"}
_REFUSED_STORAGES = {"LongStorage", "IntStorage", "ShortStorage", "CharStorage", "ByteStorage", "BoolStorage"}


class EmbedsError(ValueError):
    pass


@dataclass(frozen=True)
class Embeds:
    b64: str  # as sent: the request's prompt_embeds
    rows: int  # tokens: the placeholder ids vLLM gives the request
    hidden: int
    dtype: str
    sha256: str  # of the decoded bytes

    def describe(self) -> dict[str, Any]:
        return {"rows": self.rows, "hidden": self.hidden, "dtype": self.dtype, "sha256": self.sha256}


@dataclass(frozen=True)
class _Storage:
    dtype: str


class _TensorShape(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch" and name in _STORAGES:
            return _Storage(_STORAGES[name])
        if module == "torch" and name in _REFUSED_STORAGES:
            raise EmbedsError(f"a tensor of {name.removesuffix('Storage').lower()}s, not floats: embeddings are "
                              "floating point")
        raise EmbedsError(f"the archive names {module}.{name}, which a saved plain tensor does not: refused (a "
                          "prompts file is data, never code)")

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 2 and pid[0] == "storage" and isinstance(pid[1], _Storage):
            return pid[1]
        raise EmbedsError(f"an unexpected storage reference {pid!r:.80}")


def _rebuild(storage: Any, offset: Any, size: Any, *_: Any) -> tuple[str, tuple[int, ...]]:
    if not isinstance(storage, _Storage) or not isinstance(size, tuple):
        raise EmbedsError("not a plain tensor")
    return storage.dtype, tuple(int(n) for n in size)


def read_embeds(b64: str) -> Embeds:
    """The tensor's shape and dtype from vLLM's wire form; :class:`EmbedsError` says what is wrong."""
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise EmbedsError(f"not base64: {exc}") from None
    if len(raw) > MAX_EMBEDS_BYTES:
        raise EmbedsError(f"{len(raw)} bytes decoded, more than {MAX_EMBEDS_BYTES}")
    try:
        archive = zipfile.ZipFile(io.BytesIO(raw))
        [pkl] = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        data = archive.read(pkl)
    except (zipfile.BadZipFile, ValueError, KeyError) as exc:
        raise EmbedsError(f"not a torch.save archive of one tensor ({exc})") from None
    try:
        found = _TensorShape(io.BytesIO(data)).load()
    except EmbedsError:
        raise
    except Exception as exc:  # a damaged pickle raises whatever its opcode met; all mean the same here
        raise EmbedsError(f"not a saved tensor ({type(exc).__name__}: {exc})") from None
    if not (isinstance(found, tuple) and len(found) == 2 and isinstance(found[1], tuple)):
        raise EmbedsError("the archive holds something other than one tensor")
    dtype, shape = found
    if len(shape) == 3 and shape[0] == 1:
        shape = shape[1:]  # vLLM squeezes a batch of one
    if len(shape) != 2 or min(shape) < 1:
        raise EmbedsError(f"shape {list(found[1])}: expected (tokens, hidden)")
    return Embeds(b64=b64, rows=shape[0], hidden=shape[1], dtype=dtype, sha256=hashlib.sha256(raw).hexdigest())
