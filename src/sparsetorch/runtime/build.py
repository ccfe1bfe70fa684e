"""Find the C compiler, fingerprint it and the CPU, and compile one shared library.

Everything expensive here (``cc --version``, reading ``/proc/cpuinfo``, probing
OpenMP) runs at most once per process per ``CC`` value; a tiny kernel then costs
one compiler invocation (~0.05 s with gcc 12 on this machine).
"""
from __future__ import annotations

import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import warnings
from dataclasses import dataclass

from . import pch, tool

# -std=c99: generated code is plain C99 (restrict, int64_t, declarations in for).
# -march=native is why CPU features are part of the cache key.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c99")
LIBS = ("-lm",)  # after the source file, so the linker sees the references first
OPENMP_FLAG = "-fopenmp"

_FALLBACK_HINT = ("or use the pure-PyTorch fallback (correct but slow) with "
                  "SPARSETORCH_BACKEND=torch")


class KernelBuildError(RuntimeError):
    """A kernel could not be compiled or loaded."""


class CompilerNotFoundError(KernelBuildError):
    """No working C compiler: ``CC`` (default ``cc``) is missing or fails to run."""


class CompileTimeoutError(KernelBuildError):
    """The compiler ran past ``SPARSETORCH_COMPILE_TIMEOUT`` seconds and was killed."""


class KernelCompileError(KernelBuildError):
    """The compiler rejected a kernel; ``stderr``, ``source_path`` and ``command`` say why."""

    def __init__(self, message: str, *, stderr: str, source_path: str, command: list[str]):
        super().__init__(message)
        self.stderr = stderr
        self.source_path = source_path
        self.command = command


@dataclass(frozen=True)
class Toolchain:
    """The C compiler named by ``CC``, resolved and fingerprinted."""

    cc: str                 # the CC value as the user gave it ("cc" when unset)
    argv: tuple[str, ...]   # CC split like a shell would, argv[0] found on PATH
    realpath: str           # argv[0] with symlinks resolved
    version: str            # `CC --version` output: part of the cache key

    def identity(self) -> str:
        """What distinguishes this compiler's output: command, real binary and version."""
        return "\n".join([" ".join(self.argv), self.realpath, self.version])


_toolchains: dict[str, Toolchain] = {}
_no_openmp: set[str] = set()   # identities whose compiler lacks OpenMP (probed once)
_openmp_probed: set[str] = set()
_cpu: str | None = None


def toolchain() -> Toolchain:
    """Resolve ``CC`` (default ``cc``) and run ``--version`` once per process.

    Raises :class:`CompilerNotFoundError` naming ``CC`` and the fallback.

    Example:
        >>> from sparsetorch.runtime.build import toolchain
        >>> toolchain().argv[0].startswith("/")
        True
    """
    cc = os.environ.get("CC") or "cc"
    tc = _toolchains.get(cc)
    if tc is None:
        tc = _toolchains[cc] = _find_toolchain(cc)
    return tc


def _find_toolchain(cc: str) -> Toolchain:
    how = "CC=%r" % cc if os.environ.get("CC") else "CC is not set, so the default 'cc'"
    fix = ("Install a C compiler (gcc or clang) or point CC at one (e.g. CC=gcc), "
           + _FALLBACK_HINT + ".")
    # CC may carry arguments ("ccache gcc", "gcc -m64"), as in make.
    try:
        argv = shlex.split(cc)
    except ValueError as e:   # (an unbalanced quote)
        raise CompilerNotFoundError(f"sparsetorch cannot read {how}: {e}; quote it as a "
                                    f"shell would (e.g. CC='gcc -O2'). {fix}") from None
    exe = shutil.which(argv[0]) if argv else None
    if exe is None:
        raise CompilerNotFoundError(
            f"sparsetorch needs a C compiler to build kernels, but {how} was not found "
            f"(looked for {argv[0] if argv else cc!r} on PATH). {fix}")
    # Run it by the PATH name, not the resolved one: ccache-style symlinks dispatch on
    # argv[0]. The resolved binary goes into the key, so flipping cc -> clang rebuilds.
    argv[0] = os.path.abspath(exe)
    try:
        proc = tool.run([*argv, "--version"])
    except (OSError, subprocess.SubprocessError) as e:
        raise CompilerNotFoundError(
            f"sparsetorch could not run the C compiler {how} "
            f"(tried `{' '.join(argv)} --version`: {e}). {fix}") from e
    if proc.returncode != 0:
        raise CompilerNotFoundError(
            f"sparsetorch could not run the C compiler {how}: "
            f"`{' '.join(argv)} --version` exited with {proc.returncode}: "
            f"{proc.stderr.strip()[:500]}. {fix}")
    return Toolchain(cc=cc, argv=tuple(argv), realpath=os.path.realpath(exe),
                     version=proc.stdout.strip())


def cpu_features() -> str:
    """The CPU model and ISA flags, because ``-march=native`` code is only valid there.

    Read once per process from ``/proc/cpuinfo`` (Linux); elsewhere the machine
    and processor names from :mod:`platform` (coarser).

    Example:
        >>> from sparsetorch.runtime.build import cpu_features
        >>> isinstance(cpu_features(), str) and len(cpu_features()) > 0
        True
    """
    global _cpu
    if _cpu is None:
        wanted = ("model name", "flags", "features", "cpu model", "cpu")  # x86, arm, others
        found: dict[str, str] = {}
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    k, _, v = line.partition(":")
                    k = k.strip().lower()
                    if k in wanted and k not in found:
                        found[k] = " ".join(v.split())
                    if not line.strip() and found:
                        break  # first processor block is enough
        except OSError:
            pass
        _cpu = "\n".join([platform.machine(), platform.processor()]
                         + [f"{k}: {found[k]}" for k in sorted(found)])
    return _cpu


def compile_library(tc: Toolchain, source_path: str, out_path: str) -> tuple[str, ...]:
    """Compile ``source_path`` into the shared library ``out_path``; return the flags used.

    If the compiler fails and cannot do OpenMP at all (clang without libomp), rebuild
    without ``-fopenmp``: the kernels' ``#pragma omp`` lines are then ignored, so they
    run single-threaded but correctly. A warning says so once per process.

    Example:
        >>> import os, tempfile
        >>> from sparsetorch.runtime.build import toolchain, compile_library
        >>> d = tempfile.mkdtemp(); src = os.path.join(d, "k.c")
        >>> _ = open(src, "w").write("void k(void) {}\\n")
        >>> "-O3" in compile_library(toolchain(), src, os.path.join(d, "k.so"))
        True
    """
    ident = tc.identity()
    flags = FLAGS if ident not in _no_openmp else _without_openmp(FLAGS)
    with open(source_path) as f:
        source = f.read()
    cpu = cpu_features()
    pch_flags = pch.include_flags(tc, flags, source, cpu)
    proc = _run(tc, flags, source_path, out_path, pch_flags)
    if proc.returncode != 0 and pch_flags:   # a precompiled header GCC rejects outright
        pch.discard(tc, flags, cpu)
        proc = _run(tc, flags, source_path, out_path)
    if proc.returncode != 0 and OPENMP_FLAG in flags and openmp_missing(tc):
        flags = _without_openmp(FLAGS)
        warnings.warn(
            f"C compiler {tc.cc!r} ({tc.argv[0]}) does not support {OPENMP_FLAG}; "
            f"sparsetorch kernels are built single-threaded with flags "
            f"{' '.join(flags)}. Install OpenMP for it (e.g. libomp) or set CC=gcc.",
            RuntimeWarning, stacklevel=3)
        proc = _run(tc, flags, source_path, out_path)
    if proc.returncode != 0:
        cmd = _command(tc, flags, source_path, out_path)
        raise KernelCompileError(
            f"compiling a generated kernel failed (exit {proc.returncode}).\n"
            f"source: {source_path}\ncommand: {' '.join(cmd)}\n"
            f"compiler stderr:\n{proc.stderr.strip()}\n"
            "If the compiler's messages point at this machine (a full disk, missing headers "
            "or libraries, a CC that cannot build 64-bit shared libraries), fix that; "
            "otherwise this is a bug in sparsetorch's code generator: please report it with "
            "the source file above.",
            stderr=proc.stderr, source_path=source_path, command=cmd)
    return flags


def _without_openmp(flags: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f for f in flags if f != OPENMP_FLAG)


def _command(tc: Toolchain, flags, source_path: str, out_path: str, extra=()) -> list[str]:
    # absolute paths: a cache folder named "-x" must not reach the compiler as an option
    return [*tc.argv, *flags, *extra, os.path.abspath(source_path), "-o",
            os.path.abspath(out_path), *LIBS]


def _run(tc: Toolchain, flags, source_path: str, out_path: str, extra=()):
    cmd = _command(tc, flags, source_path, out_path, extra)
    try:
        return tool.run(cmd)
    except subprocess.TimeoutExpired as e:
        raise CompileTimeoutError(
            f"the C compiler CC={tc.cc!r} ran past {e.timeout:g} s compiling {source_path} "
            f"and was stopped (with everything it started). On a busy machine allow it more "
            f"with {tool.TIMEOUT_ENV}=300; if it hangs, check the compiler on its own: "
            f"{' '.join(cmd)}") from None
    except OSError as e:
        raise CompilerNotFoundError(
            f"sparsetorch could not run the C compiler CC={tc.cc!r} "
            f"(tried `{' '.join(cmd)}`: {e}). Point CC at a working compiler, "
            + _FALLBACK_HINT + ".") from e


_OMP_PROBE = ("int probe(int n) { int s = 0;\n#pragma omp parallel for reduction(+:s)\n"
              "for (int i = 0; i < n; i++) s += i;\nreturn s; }\n")


def _lacks_openmp(tc: Toolchain) -> bool:
    """Whether the compiler builds a trivial library without OpenMP but not with it. Only
    asked after a failed build, so a genuine error inside a pragma is not mistaken for
    missing OpenMP, nor is a failure of any build (a full disk, missing headers: a probe
    took those for it, and every kernel after was built, and cached, single-threaded)."""
    with tempfile.TemporaryDirectory(prefix="sparsetorch-omp-") as d:
        src = os.path.join(d, "probe.c")
        with open(src, "w") as f:
            f.write(_OMP_PROBE)
        out = os.path.join(d, "probe.so")
        if _run(tc, FLAGS, src, out).returncode == 0:
            return False
        return _run(tc, _without_openmp(FLAGS), src, out).returncode == 0


def openmp_missing(tc: Toolchain) -> bool:
    """Whether ``tc`` lacks OpenMP (its kernels are built single-threaded), probed once per
    process: asked where a cached kernel was built without it.

    Example:
        >>> openmp_missing(toolchain())    # (gcc and clang with libomp have it)
        False
    """
    ident = tc.identity()
    if ident not in _openmp_probed:
        _openmp_probed.add(ident)
        if _lacks_openmp(tc):
            _no_openmp.add(ident)
    return ident in _no_openmp
