#!/usr/bin/env bash
# The Python packages the services need that the lent GPU machines' image lacks (fastapi,
# uvicorn, pydantic, grpc health, gguf and what they import), as wheels for Python 3.12 in
# .whl/ (ignored by git), the versions this checkout's venv runs. A device call carries .whl
# and starts with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# (bench/gpu_checks.sh does that itself when .whl/ is there). About 5 MB in all.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
NAMES="fastapi starlette pydantic pydantic_core annotated-types typing-inspection uvicorn h11
click grpcio-health-checking gguf"
pins=$("$PY" -m pip freeze | tr 'A-Z_' 'a-z-')
mkdir -p .whl
for name in $NAMES; do
    key=$(echo "$name" | tr 'A-Z_' 'a-z-')
    pin=$(echo "$pins" | grep "^$key==" || true)
    [ -n "$pin" ] || { echo "not in the venv: $name" >&2; exit 1; }
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "$pin"
done
du -sh .whl
