"""A length model on disk: a compressed .npz of plain arrays, read without pickle.

``np.load(..., allow_pickle=False)`` refuses any object array, so a model file
can hold numbers and strings only: loading one runs no code.  Written by
``binbatch predictor train`` and read by ``predictor.warmStart``.  What ``save_model`` writes fits a ConfigMap (``MAX_FILE_BYTES``):
the arrays are sparse float16 (``LengthModel.to_arrays``) and deflated.  Files in the
older dense layout (uncompressed float32, about 4 MiB) are still read.
"""

from __future__ import annotations

import io
import os
import zipfile

import numpy as np

from ..core.length_model import LengthModel


MAX_FILE_BYTES = 700 * 1024  # base64 in a ConfigMap's binaryData (4/3 of it) stays under the API's 1 MiB


class ModelFileError(ValueError):
    """The file is not a readable length model; the message says why."""


def save_model(path: str | os.PathLike[str], model: LengthModel) -> None:
    """Write ``model`` to ``path`` (a file object is given, so numpy adds no ``.npz`` to the name)."""
    with open(path, "wb") as f:
        np.savez_compressed(f, **model.to_arrays())


def model_bytes(model: LengthModel) -> bytes:
    """The file ``save_model`` writes, as bytes (what the operator publishes in a ConfigMap)."""
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **model.to_arrays())
    return buffer.getvalue()


def load_model(path: str | os.PathLike[str]) -> LengthModel:
    """Read a model written by ``save_model``; ``ModelFileError`` says what is wrong."""
    name = os.fspath(path)
    try:
        with open(path, "rb") as f:
            if not zipfile.is_zipfile(f):  # np.load would take it for a pickle and say so
                raise ModelFileError(f"{name} is not a model file written by `binbatch predictor train` (not an .npz)")
            f.seek(0)
            with np.load(f, allow_pickle=False) as arrays:
                return LengthModel.from_arrays({k: arrays[k] for k in arrays.files})
    except OSError as exc:
        raise ModelFileError(f"cannot read {name}: {(exc.strerror or str(exc)).lower()}") from None
    except (zipfile.BadZipFile, EOFError, KeyError) as exc:
        raise ModelFileError(f"{name} is not a model file written by `binbatch predictor train` ({exc})") from None
    except ModelFileError:
        raise
    except ValueError as exc:  # from_arrays, or an object array numpy refused to unpickle
        raise ModelFileError(f"{name}: {exc}") from None
