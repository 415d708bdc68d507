"""The compiled CPU backend of :func:`cloud_verifier.verdict.scan.scan_logits`: the sampled positions' scan in C
(``scan_native.c``, next to this file), with the contract of :mod:`cloud_verifier.verdict.scan_numpy`
and its arithmetic operation for operation.

Why compiled: the numpy backend makes five passes over each row's logits (max, two comparisons, a count and a
nonzero, each a separate ufunc over [positions, vocab_size]) and then a vectorised step over the gathered tokens
whose many small numpy calls cost as much again; in C a position is one pass from memory (the max, AVX2) and one
in cache (count and gather fused, a branch per 8 tokens), and the normaliser and candidates over the few hundred
gathered tokens take microseconds. The library is compiled on first use with the system's C compiler (``cc``,
or ``$CC``; about 0.5 s) into the model cache (``$SPECDEC_CACHE_DIR/native``, else a temp folder; keyed by the
source, the flags and the CPU) and
loaded with ctypes, which releases the GIL during the call, so several threads scan at once. Without a compiler
at run time (a container image), the variants :func:`prebuild` compiled at build time into
``$SPECDEC_NATIVE_SCAN_DIR`` are used: the widest instruction set the CPU has (AVX-512, AVX2, plain C). Without either, or with
``SPECDEC_NATIVE_SCAN=0``, :func:`available` is False and the numpy backend is used.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from specdec_runtime.cloud_verifier.verdict.scan_numpy import BOUND_GAP, BUCKETS_PER_UNIT, EXACT_GAP, run_threaded

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("scan_native.c")
_FLAG_SETS = (["-O3", "-march=native"], ["-O3"])  # the second where the compiler does not know the first
# the variants compiled ahead of time (:func:`prebuild`), widest first; each used only where the CPU has its ISA
_PREBUILT = (("avx512f", ["-O3", "-mavx512f"]), ("avx2", ["-O3", "-mavx2"]), ("generic", ["-O3"]))
PREBUILT_DIR_ENV = "SPECDEC_NATIVE_SCAN_DIR"
_POSITIONS_PER_TASK = 16  # sampled positions per call (several calls share the threads)
_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_ARGTYPES = [_i64, _p, _i64, _p, _i64, ctypes.c_double, ctypes.c_double, _i64, _p, _p, _p, _p, _p, _p]
_ARGMAX_ARGTYPES = [_i64, _p, _i64, _p, _p]


def available() -> bool:
    """Whether the compiled scan can be used here (compiled now if needed; False without a C compiler)."""
    return _library() is not None


def _cpu_flags_line() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _cpu_fingerprint() -> str:
    return platform.machine() + platform.processor() + _cpu_flags_line()


def _prebuilt_path(directory: Path, isa: str) -> Path:
    # keyed by the source: a library built from another version of scan_native.c is never loaded
    return directory / f"verdict_scan-{isa}-{hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:16]}.so"


def prebuild(directory: Path, compiler: str = "cc") -> list[Path]:
    """Compile every ahead-of-time variant (AVX-512, AVX2, plain C) into ``directory``, for a machine that has no
    C compiler at run time (``SPECDEC_NATIVE_SCAN_DIR=directory`` there). Returns the files written.

    Raises:
        OSError, subprocess.SubprocessError: no compiler, a failed build, a folder that cannot be written."""
    paths = []
    for isa, flags in _PREBUILT:
        path = _prebuilt_path(directory, isa)
        compile_to(path, compiler, flags)
        path.chmod(0o755)  # for every user of the image, not only the one that built it
        paths.append(path)
    return paths


def _prebuilt():
    """The widest variant :func:`prebuild` left in ``$SPECDEC_NATIVE_SCAN_DIR`` that this CPU runs, else None."""
    directory = os.environ.get(PREBUILT_DIR_ENV)
    if not directory:
        return None
    cpu = set(_cpu_flags_line().partition(":")[2].split())
    for isa, _ in _PREBUILT:
        path = _prebuilt_path(Path(directory), isa)
        if (isa == "generic" or isa in cpu) and path.exists():
            try:
                return load(path)
            except OSError as e:
                log.info("the prebuilt verdict scan %s does not load: %s", path, e)
    return None


@functools.cache
def _library():
    if os.environ.get("SPECDEC_NATIVE_SCAN", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        lib = _prebuilt()
        if lib is None:
            log.info("no C compiler and no prebuilt library: the verdict scan runs in numpy")
        return lib
    from specdec_runtime.common.paths import default_cache_dir

    source = _SOURCE.read_bytes()
    # the model cache may be read-only to the service's user (a container image): then a private temp folder
    directories = [default_cache_dir() / "native",
                   Path(tempfile.gettempdir()) / f"specdec-native-{os.getuid() if hasattr(os, 'getuid') else 0}"]
    last_error = ""
    for flags, directory in ((f, d) for f in _FLAG_SETS for d in directories):
        key = hashlib.sha256(source + " ".join([compiler, *flags]).encode() + _cpu_fingerprint().encode())
        path = directory / f"verdict_scan-{key.hexdigest()[:16]}.so"
        try:
            if not path.exists():
                compile_to(path, compiler, flags)
            return load(path)
        except (OSError, subprocess.SubprocessError) as e:
            last_error = f"{compiler} {' '.join(flags)} into {directory}: {e}"
            log.info("compiling the verdict scan with %s failed", last_error)
    log.warning("the compiled verdict scan is unavailable (the last try, %s): the scan runs in numpy", last_error)
    return None


def load(path: Path) -> ctypes.CDLL:
    """The compiled scan at ``path`` (built by :func:`compile_to`), its functions typed.

    Raises:
        OSError: it cannot be loaded."""
    lib = ctypes.CDLL(str(path))
    lib.scan_sampled.argtypes = _ARGTYPES
    lib.scan_sampled.restype = ctypes.c_int
    lib.argmax_greedy.argtypes = _ARGMAX_ARGTYPES
    lib.argmax_greedy.restype = None
    return lib


def compile_to(path: Path, compiler: str, flags: list[str]) -> None:
    """Compile the source into ``path`` (atomically: a concurrent process sees the old file or the new one).

    Raises:
        OSError, subprocess.SubprocessError: no compiler, a failed build, a folder that cannot be written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, "-shared", "-fPIC", "-o", tmp, str(_SOURCE), "-lm"], check=True,
                       capture_output=True, timeout=120)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def scan_native(
    rows: list[torch.Tensor],  # per verify row [positions, vocab_size] float32, on the CPU
    valid_vocab_size: int,
    sampled: np.ndarray,  # [num_tokens] bool
    temperature: np.ndarray,  # [num_tokens] float64 (used where sampled, > 0 there)
    c: int,  # candidates per sampled position, 1 <= c <= valid_vocab_size
    threads: int = 1,
    lib: ctypes.CDLL | None = None,  # a library of :func:`load`; None: this machine's (compiled if needed)
) -> tuple:
    """:func:`cloud_verifier.verdict.scan_numpy.scan_numpy`'s fields (same shapes, dtypes and padding), every
    position scanned in C (greedy ones: the argmax and its logit, as numpy's argmax).

    Raises:
        RuntimeError: the compiled library is unavailable (check :func:`available` first) or out of memory.
    """
    lib = lib or _library()
    if lib is None:
        raise RuntimeError("the compiled verdict scan is unavailable")
    num_tokens = len(sampled)
    max_logit = np.empty(num_tokens, dtype=np.float32)  # [num_tokens]
    argmax = np.zeros(num_tokens, dtype=np.int64)  # [num_tokens]
    pointers, keep = _pointers(rows, valid_vocab_size)  # [num_tokens] each position's first logit
    greedy_at = np.flatnonzero(~sampled)
    if greedy_at.size:
        g_ptr = np.ascontiguousarray(pointers[greedy_at])
        g_arg, g_max = np.empty(greedy_at.size, dtype=np.int64), np.empty(greedy_at.size, dtype=np.float32)
        run_threaded(lambda lo: lib.argmax_greedy(min(_POSITIONS_PER_TASK, greedy_at.size - lo),
                                                  g_ptr.ctypes.data + 8 * lo, valid_vocab_size,
                                                  g_arg.ctypes.data + 8 * lo, g_max.ctypes.data + 4 * lo),
                     list(range(0, greedy_at.size, _POSITIONS_PER_TASK)), threads)
        argmax[greedy_at], max_logit[greedy_at] = g_arg, g_max
    at_s = np.flatnonzero(sampled)
    s = len(at_s)
    s_ptr = np.ascontiguousarray(pointers[at_s])
    t = np.ascontiguousarray(temperature[at_s], dtype=np.float64)  # [s]
    m = np.empty(s, dtype=np.float32)
    cand = np.empty((s, c), dtype=np.float32)
    cand_ids = np.empty((s, c), dtype=np.int64)
    z_low, z_high = np.empty(s), np.empty(s)
    outside = np.empty(s, dtype=np.float32)

    def part(lo: int) -> int:
        n = min(_POSITIONS_PER_TASK, s - lo)
        return lib.scan_sampled(
            n, s_ptr.ctypes.data + 8 * lo, valid_vocab_size, t.ctypes.data + 8 * lo, c, EXACT_GAP, BOUND_GAP,
            BUCKETS_PER_UNIT, m.ctypes.data + 4 * lo, cand.ctypes.data + 4 * c * lo,
            cand_ids.ctypes.data + 8 * c * lo, z_low.ctypes.data + 8 * lo, z_high.ctypes.data + 8 * lo,
            outside.ctypes.data + 4 * lo)

    if any(run_threaded(part, list(range(0, s, _POSITIONS_PER_TASK)), threads)):
        raise RuntimeError("the compiled verdict scan ran out of memory")
    del keep
    max_logit[at_s] = m
    return max_logit, argmax, cand, cand_ids, z_low, z_high, outside


def _pointers(rows: list[torch.Tensor], vocab: int) -> tuple[np.ndarray, list]:
    """Every position's address ([num_tokens] uint64, row after row) and the copies they point into (rows whose
    tokens are not adjacent), to be kept alive until the scan returns: a few vectorised ops for the whole
    batch, no per-row numpy call."""
    keep: list[torch.Tensor] = []
    sizes = np.fromiter((x.shape[0] for x in rows), dtype=np.int64, count=len(rows))
    bases, strides = np.empty(len(rows), dtype=np.uint64), np.empty(len(rows), dtype=np.uint64)
    for i, x in enumerate(rows):
        if x.stride(-1) != 1:  # tokens not adjacent: a contiguous copy (the C passes read them in a row)
            x = x[:, :vocab].contiguous()
            keep.append(x)
        bases[i], strides[i] = x.data_ptr(), x.stride(0) * x.element_size()
    row = np.repeat(np.arange(len(rows)), sizes)  # [num_tokens]
    local = (np.arange(int(sizes.sum())) - (np.cumsum(sizes) - sizes)[row]).astype(np.uint64)
    return bases[row] + local * strides[row], keep
