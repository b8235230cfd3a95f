"""The native decoder: a stack of decoder layers in one C++ call (``decoder.cpp``), for the
4-bit target and for drafters' prepacked or 4-bit layers.

Built on first use with torch's extension builder (a C++ compiler is needed; about a minute
on two cores) into ``$LYANNA_NATIVE_DIR`` (default ``$LYANNA_CACHE/native``)/<key>-<checkout>,
where the key covers the source, torch's version and this CPU's instruction set, so a cache
shared by different machines never loads a binary built for another CPU, and the checkout
is a hash of the source's path. When it cannot be built,
``load_decoder`` returns None and the model runs its eager path (``LYANNA_NATIVE=0`` forces
that).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from lyanna.model.paths import cache_root

SOURCE = Path(__file__).with_name("decoder.cpp")
SOURCES = (
    SOURCE,
    *(SOURCE.with_name(h) for h in ("block_matmul.h", "vector_math.h")),
)  # what the build key covers
# at::parallel_for is OpenMP in torch's headers: without -fopenmp it runs on one thread
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp")
log = logging.getLogger(__name__)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_key(flags: tuple[str, ...] = FLAGS) -> str:
    digest = hashlib.sha256()
    for part in SOURCES:
        digest.update(part.read_bytes())
    digest.update(" ".join(flags).encode())
    digest.update(torch.__version__.encode())
    digest.update(_cpu_flags().encode())
    return digest.hexdigest()[:16]


def native_enabled() -> bool:
    return os.environ.get("LYANNA_NATIVE", "1") != "0"


@cache
def load_decoder() -> ModuleType | None:
    """The compiled extension, or None when disabled or unbuildable (logged once)."""
    return _build(FLAGS) if native_enabled() else None


@cache
def load_decoder_variant(define: str) -> ModuleType | None:
    """The extension built with ``-D<define>`` (tests: ``LYANNA_BLOCKS_AVX2`` forces the
    AVX2 products on an AVX-512 machine, so both paths are checked wherever tests run)."""
    return _build((*FLAGS, f"-D{define}"))


def _build(flags: tuple[str, ...]) -> ModuleType | None:
    from torch.utils.cpp_extension import load

    key = build_key(flags)
    # one build directory per checkout too: ninja's build file names the source by its path,
    # so two checkouts sharing a directory rebuild each other's library over and over (and a
    # process killed mid-build leaves torch's lock behind for every later one)
    checkout = hashlib.sha256(str(SOURCE.resolve()).encode()).hexdigest()[:8]
    root = Path(os.environ.get("LYANNA_NATIVE_DIR", cache_root() / "native"))
    build_dir = root / f"{key}-{checkout}"
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        return load(
            name=f"lyanna_decoder_{key}",
            sources=[str(SOURCE)],
            extra_cflags=list(flags),
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as exc:  # no compiler, headers, linker or writable directory
        log.warning("native decoder unavailable, using the eager path: %s", exc)
        return None
