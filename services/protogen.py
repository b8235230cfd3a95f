"""Regenerate the Python stubs in ``services/pb`` from ``proto/lyanna/v1/*.proto``.

protoc names Python modules after proto file paths, so ``lyanna/v1/common.proto`` would import
as ``lyanna.v1.common_pb2`` - inside our core package. This script generates into a scratch
directory and rewrites those imports to ``services.pb``, writing flat modules
(``common_pb2.py``, ``verifier_pb2_grpc.py``, ...). Run ``make proto`` or
``python -m services.protogen [--out DIR]``; a test regenerates into a temporary directory
and fails when the committed stubs are stale.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
PROTO_PACKAGE_DIR = Path("lyanna") / "v1"
DEFAULT_OUT = ROOT / "services" / "pb"
PYTHON_PACKAGE = "services.pb"
_IMPORT = re.compile(r"^from lyanna\.v1 import (\w+) as (\w+)$", re.MULTILINE)


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / PROTO_PACKAGE_DIR).glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs into ``out_dir``; returns the written files."""
    from grpc_tools import protoc

    include = resources.files("grpc_tools") / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as scratch:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={scratch}",
            f"--pyi_out={scratch}",
            f"--grpc_python_out={scratch}",
            *(str(p.relative_to(PROTO_ROOT)) for p in proto_files()),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        for path in sorted((Path(scratch) / PROTO_PACKAGE_DIR).iterdir()):
            text = _IMPORT.sub(rf"from {PYTHON_PACKAGE} import \1 as \2", path.read_text())
            target = out_dir / path.name
            target.write_text(text)
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
