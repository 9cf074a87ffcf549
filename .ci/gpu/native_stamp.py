"""The stamp of the native modules' sources: one hash of every file the CMake build reads (its
C++/CUDA sources and CMake files, pyproject.toml) and of the interpreter and jaxlib it builds
against. `.ci/gpu/prebuilt.sh` writes it beside modules built on the development machine and
checks it on the GPU machine, so that modules built from another tree are never used.

  python3 .ci/gpu/native_stamp.py            # prints the stamp of this tree and interpreter
"""

from __future__ import annotations

import hashlib
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE_SUFFIXES = {".cc", ".cu", ".cuh", ".h", ".cmake"}


def source_files() -> list[pathlib.Path]:
  """The build's inputs: CMakeLists.txt, pyproject.toml and the sources under cuda/."""
  files = [ROOT / "CMakeLists.txt", ROOT / "pyproject.toml"]
  files += [p for p in (ROOT / "cuda").rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES]
  return sorted(files)


def stamp() -> str:
  """The hash of the sources (paths and contents), the Python minor version and jaxlib's."""
  import jaxlib  # the FFI headers the modules were built against

  digest = hashlib.sha256()
  digest.update(f"python {sys.version_info[0]}.{sys.version_info[1]} jaxlib {jaxlib.__version__}\n".encode())
  for path in source_files():
    digest.update(str(path.relative_to(ROOT)).encode() + b"\0")
    digest.update(path.read_bytes() + b"\0")
  return digest.hexdigest()


if __name__ == "__main__":
  print(stamp())
