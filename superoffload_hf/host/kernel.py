"""Host Adam back ends: the JIT-built GraceAdam kernel (C++), or the PyTorch reference.

``get_host_adam(mode, threads, isa)`` returns an object with one signature whichever back end
serves it (``name``, ``isa``, ``threads``, ``adam_step_``, ``adam_rollback_``, ``sum_squares``,
``set_num_threads``, ``describe``; for the compact state of host/compact.py ``compact_step_``,
``compact_encode_``, ``compact_decode`` and ``bytes_copy_``). The math of both is in `superoffload_hf.host.reference`.
Every gradient argument may also be a `SegmentedGrad` (host/segmented.py: the gradient as the
tensors autograd produced, read in place).

The kernel (csrc/grace_adam/; in a wheel, superoffload_hf/_csrc/grace_adam/) is built once with
``torch.utils.cpp_extension.load`` + ninja into a cache directory keyed by the sources, flags,
torch, Python and platform (``~/.cache/superoffload_hf/``, or ``$SUPEROFFLOAD_CACHE_DIR``), and
later processes load the cached library without rebuilding; a finished build loads without the
cache's lock, so the cache may be read-only once it holds the build. One build serves every
instruction set: each ISA file selects its own target, and the ISA is chosen at run time. ``SUPEROFFLOAD_FORCE_REFERENCE=1`` forces
the reference. ``SUPEROFFLOAD_REQUIRE_KERNEL=1`` (the GPU check sets it) makes "auto" an error when the
kernel cannot be built, and refuses ``SUPEROFFLOAD_FORCE_REFERENCE``: no silent fallback.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import numbers
import os
import platform
import shutil
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch

from superoffload_hf.host import compact, reference
from superoffload_hf.host.segmented import SegmentedGrad

MODES = ("auto", "cpp", "reference")
ISA_CODES = {"scalar": 0, "avx2": 1, "avx512": 2, "neon": 3, "sve": 4}
CFLAGS = ("-O3", "-ffp-contract=off", "-std=c++17")
FORCE_REFERENCE_ENV = "SUPEROFFLOAD_FORCE_REFERENCE"
REQUIRE_KERNEL_ENV = "SUPEROFFLOAD_REQUIRE_KERNEL"
CACHE_DIR_ENV = "SUPEROFFLOAD_CACHE_DIR"



def _find_source_dir() -> Path:
    """The C++ sources: inside the installed package (`superoffload_hf/_csrc/grace_adam`, where the
    wheel build copies them; see setup.py), else in the source checkout (`csrc/grace_adam`)."""
    package = Path(__file__).resolve().parents[1]
    installed = package / "_csrc" / "grace_adam"
    return installed if installed.is_dir() else package.parent / "csrc" / "grace_adam"


SOURCE_DIR = _find_source_dir()
_COMMON_SOURCES = ("binding.cpp", "dispatch.cpp", "adam_scalar.cpp")
_ISA_SOURCES = {"x86_64": ("adam_avx2.cpp", "adam_avx512.cpp"), "aarch64": ("adam_neon.cpp", "adam_sve.cpp")}
_HEADERS = ("grace_adam.h", "thread_pool.h")


class KernelBuildError(RuntimeError):
    """The GraceAdam extension could not be built or loaded."""


# ---- the two back ends ---------------------------------------------------------------------------


def _check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise ValueError(f"`step` is {step!r}; expected the 1-based count of the step being taken (an int >= 1).")
    return int(step)


def _as_float(name: str, value) -> float:
    try:
        if isinstance(value, (str, bytes)):  # e.g. "1e-3" from YAML, which reads it as a string
            raise TypeError
        return float(value)  # numbers and one-element tensors (LR schedulers may hand out either)
    except (TypeError, ValueError):
        raise TypeError(f"`{name}` is {value!r}; expected a real number.") from None


_HYPER_NAMES = ("step", "lr", "beta1", "beta2", "eps", "weight_decay", "adamw", "bias_correction", "grad_scale")


def _binding_hyper(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale) -> tuple:
    """The hyperparameters in the binding's positional order, checked and converted."""
    floats = [_as_float(name, value) for name, value in (("lr", lr), ("beta1", beta1), ("beta2", beta2),
                                                          ("eps", eps), ("weight_decay", weight_decay))]
    return (_check_step(step), *floats, bool(adamw), bool(bias_correction), _as_float("grad_scale", grad_scale))


def _flat(grad) -> torch.Tensor:
    """The flat gradient the reference steps with (a SegmentedGrad concatenated: a copy)."""
    if isinstance(grad, SegmentedGrad):
        grad.tensors()  # raises, as the kernel does, when a segment to step is absent
        return grad.cat()
    return grad


class ReferenceHostAdam:
    """The PyTorch reference (superoffload_hf.host.reference) behind the host Adam interface,
    including the gradient staging ops ``grad_copy_`` / ``grad_accumulate_`` (torch's own pool)."""

    name = "reference"
    isa = "none"

    def __init__(self, threads: int, reason: str = "requested") -> None:
        self.threads = threads
        self.reason = reason

    def adam_step_(self, param, exp_avg, exp_avg_sq, grad, *, step, lr, beta1, beta2, eps, weight_decay,
                   adamw, bias_correction=True, grad_scale=1.0, param_lowp=None) -> None:
        hyper = _binding_hyper(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale)
        reference.adam_step_(param, exp_avg, exp_avg_sq, _flat(grad), param_lowp=param_lowp,
                             **dict(zip(_HYPER_NAMES, hyper)))

    def adam_rollback_(self, param, exp_avg, exp_avg_sq, grad, *, step, lr, beta1, beta2, eps, weight_decay,
                       adamw, bias_correction=True, grad_scale=1.0, param_lowp=None) -> None:
        hyper = _binding_hyper(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale)
        reference.adam_rollback_(param, exp_avg, exp_avg_sq, _flat(grad), param_lowp=param_lowp,
                                 **dict(zip(_HYPER_NAMES, hyper)))

    def sum_squares(self, grad) -> float:
        return reference.sum_squares(grad.cat() if isinstance(grad, SegmentedGrad) else grad)

    def compact_step_(self, master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale,
                      grad, *, step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction=True,
                      grad_scale=1.0) -> None:
        """One Adam step on the compact state (host/compact.py): decode, fp32 update, encode."""
        hyper = _binding_hyper(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale)
        compact.compact_step_(master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale,
                              _flat(grad), **dict(zip(_HYPER_NAMES, hyper)))

    def compact_encode_(self, master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale,
                        param, exp_avg, exp_avg_sq) -> None:
        compact.compact_encode_(master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale,
                                param, exp_avg, exp_avg_sq)

    def compact_decode(self, master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale,
                       param, exp_avg, exp_avg_sq) -> None:
        compact.compact_decode(master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale,
                               param, exp_avg, exp_avg_sq)

    def bytes_copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        compact.bytes_copy_(dst, src)

    def grad_copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        reference.grad_copy_(dst, src)

    def grad_accumulate_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        reference.grad_accumulate_(dst, src)

    def lowp_copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        reference.lowp_copy_(dst, src)

    def set_num_threads(self, n: int) -> None:
        self.threads = _check_threads(n)

    def describe(self) -> str:
        return f"host Adam: reference (PyTorch ops; {self.reason})"


class CppHostAdam:
    """The GraceAdam kernel. Its thread pool belongs to the process (shared by every instance); every
    method, ``grad_copy_`` / ``grad_accumulate_`` included, runs on it with the GIL released."""

    name = "cpp"

    def __init__(self, extension, isa: str) -> None:
        self._ext = extension
        self.isa = isa
        self._isa_code = ISA_CODES[isa]

    @property
    def threads(self) -> int:
        return int(self._ext.get_num_threads())

    def adam_step_(self, param, exp_avg, exp_avg_sq, grad, *, step, lr, beta1, beta2, eps, weight_decay,
                   adamw, bias_correction=True, grad_scale=1.0, param_lowp=None) -> None:
        hyper = _binding_hyper(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale)
        if isinstance(grad, SegmentedGrad):  # read in place, segment by segment
            self._ext.adam_step_segments_(param, exp_avg, exp_avg_sq, grad.tensors(), param_lowp, *hyper,
                                          self._isa_code)
        else:
            self._ext.adam_step_(param, exp_avg, exp_avg_sq, grad, param_lowp, *hyper, self._isa_code)

    def adam_rollback_(self, param, exp_avg, exp_avg_sq, grad, *, step, lr, beta1, beta2, eps, weight_decay,
                       adamw, bias_correction=True, grad_scale=1.0, param_lowp=None) -> None:
        hyper = _binding_hyper(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale)
        if isinstance(grad, SegmentedGrad):
            self._ext.adam_rollback_segments_(param, exp_avg, exp_avg_sq, grad.tensors(), param_lowp, *hyper,
                                              self._isa_code)
        else:
            self._ext.adam_rollback_(param, exp_avg, exp_avg_sq, grad, param_lowp, *hyper, self._isa_code)

    def sum_squares(self, grad) -> float:
        """float64; a SegmentedGrad in blocks within each segment (its absent segments are zeros),
        so its last bits may differ from those of the concatenation."""
        if isinstance(grad, SegmentedGrad):
            return float(self._ext.sum_squares_segments(grad.present(), self._isa_code))
        return float(self._ext.sum_squares(grad, self._isa_code))

    def compact_step_(self, master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale,
                      grad, *, step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction=True,
                      grad_scale=1.0) -> None:
        """One Adam step on the compact state (host/compact.py), bitwise equal to the reference."""
        hyper = _binding_hyper(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale)
        state = (master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale)
        if isinstance(grad, SegmentedGrad):  # read in place, segment by segment
            self._ext.compact_step_segments_(*state, grad.tensors(), *hyper, self._isa_code)
        else:
            self._ext.compact_step_(*state, grad, *hyper, self._isa_code)

    def compact_encode_(self, master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale,
                        param, exp_avg, exp_avg_sq) -> None:
        """fp32 state -> compact bytes on the kernel's threads (float64 inputs are rounded to fp32 first)."""
        fp32 = [t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.float64 else t
                for t in (param, exp_avg, exp_avg_sq)]
        self._ext.compact_encode_(master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale,
                                  *fp32)

    def compact_decode(self, master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale,
                       param, exp_avg, exp_avg_sq) -> None:
        """compact bytes -> fp32 state on the kernel's threads (float64 outputs get the same, exact, values)."""
        outputs = (param, exp_avg, exp_avg_sq)
        fp32 = [torch.empty_like(t, dtype=torch.float32) if isinstance(t, torch.Tensor) and t.dtype == torch.float64
                else t for t in outputs]
        self._ext.compact_decode_(master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale,
                                  *fp32)
        for out, tmp in zip(outputs, fp32):
            if tmp is not out:
                out.copy_(tmp)

    def bytes_copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst = src bit for bit (same dtype and numel, any dtype), on the kernel's threads."""
        self._ext.bytes_copy_(dst, src)

    def grad_copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst = float(src) on the kernel's threads (src fp32/bf16/fp16, dst fp32, same numel)."""
        self._ext.grad_copy_(dst, src, self._isa_code)

    def grad_accumulate_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst += float(src), one fp32 add per element, on the kernel's threads."""
        self._ext.grad_accumulate_(dst, src, self._isa_code)

    def lowp_copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst (bf16/fp16) = src (fp32) rounded to nearest even, on the kernel's threads."""
        self._ext.lowp_copy_(dst, src)

    def set_num_threads(self, n: int) -> None:
        self._ext.set_num_threads(_check_threads(n))

    def describe(self) -> str:
        return (f"host Adam: cpp (GraceAdam, isa {self.isa}, {self.threads} threads; "
                f"supported isas: {', '.join(supported_isas(self._ext))})")


# ---- choosing a back end -------------------------------------------------------------------------

_last_backend = None
_warned_fallback = False


def get_host_adam(mode: str = "auto", threads: Optional[int] = None, isa: Optional[str] = None):
    """The host Adam back end for `mode` ("auto" | "cpp" | "reference"), `threads` (None: the cores
    this process may run on) and `isa` (None: the best this CPU supports)."""
    global _last_backend
    if mode not in MODES:
        raise ValueError(f"`mode` is {mode!r}; valid choices are {list(MODES)}.")
    if isa is not None and isa not in ISA_CODES:
        raise ValueError(f"`isa` is {isa!r}; valid choices are None (the best supported) or {list(ISA_CODES)}.")
    threads = default_threads() if threads is None else _check_threads(threads)
    _last_backend = _choose_backend(mode, threads, isa)
    return _last_backend


def _choose_backend(mode: str, threads: int, isa: Optional[str]):
    required = os.environ.get(REQUIRE_KERNEL_ENV, "") not in ("", "0")
    if os.environ.get(FORCE_REFERENCE_ENV, "") not in ("", "0"):
        if required and mode != "reference":
            raise KernelBuildError(f"{FORCE_REFERENCE_ENV} and {REQUIRE_KERNEL_ENV} are both set: the first forces "
                                   f"the reference host Adam, the second forbids it. Unset one of them.")
        return ReferenceHostAdam(threads, reason=f"forced by {FORCE_REFERENCE_ENV}=1")
    if mode == "reference":
        return ReferenceHostAdam(threads, reason="mode='reference'")
    try:
        extension = load_extension()
    except KernelBuildError as error:
        if mode == "cpp" or required:
            raise
        _warn_fallback_once(error)
        return ReferenceHostAdam(threads, reason=f"fallback: {str(error).splitlines()[0]}")
    backend = CppHostAdam(extension, _resolve_isa(extension, isa))
    backend.set_num_threads(threads)
    return backend


def _resolve_isa(extension, isa: Optional[str]) -> str:
    if isa is None:
        return extension.isa_name(extension.best_isa())
    if not extension.isa_supported(ISA_CODES[isa]):
        raise ValueError(f"`isa` is {isa!r}, which this CPU does not support; supported: "
                         f"{supported_isas(extension)} (or None for the best of them).")
    return isa


def _warn_fallback_once(error: Exception) -> None:
    global _warned_fallback
    if _warned_fallback:
        return
    _warned_fallback = True
    warnings.warn(f"{error}\nFalling back to the (slower) PyTorch reference host Adam. Pass "
                  "host_kernel='cpp' to make this an error.", RuntimeWarning, stacklevel=4)


def supported_isas(extension=None) -> list:
    extension = extension or load_extension()
    return [name for name, code in ISA_CODES.items() if extension.isa_supported(code)]


def default_threads() -> int:
    """The cores this process may run on (whatever OMP_NUM_THREADS says)."""
    return len(os.sched_getaffinity(0))


def _check_threads(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"`threads` is {n!r}; expected an int >= 1 (or None for every core this process may use).")
    return n


def describe(backend=None) -> str:
    """One line naming the host Adam in use: `backend`, or the last one get_host_adam returned."""
    backend = backend or _last_backend
    if backend is None:
        return "host Adam: none chosen yet (call get_host_adam)"
    return backend.describe()


# ---- building and loading the extension ----------------------------------------------------------

_extension = None
_extension_error: Optional[KernelBuildError] = None
_extension_lock = threading.Lock()


def load_extension():
    """The GraceAdam extension module: built at most once per process (a failure is remembered, so
    it is not retried), and cached on disk across processes."""
    global _extension, _extension_error
    with _extension_lock:
        if _extension is None and _extension_error is None:
            root = cache_root()
            try:
                _extension = _build_or_load(SOURCE_DIR, root)
            except KernelBuildError as error:
                _extension_error = error
            except Exception as error:  # any other failure to build or load: the same fallback
                _extension_error = KernelBuildError(
                    f"Loading the GraceAdam host Adam kernel from the cache {root} failed: "
                    f"{type(error).__name__}: {error}. Delete that directory to rebuild, or set "
                    f"{CACHE_DIR_ENV} to another writable directory.")
                _extension_error.__cause__ = error
        if _extension_error is not None:
            raise KernelBuildError(str(_extension_error)) from _extension_error
        return _extension


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "superoffload_hf")


def source_files(source_dir: Path) -> list:
    machine = platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    names = _COMMON_SOURCES + _ISA_SOURCES.get(machine, ())
    return [source_dir / name for name in names]


def build_key(source_dir: Path) -> str:
    """A hash of everything that makes one build differ from another."""
    digest = hashlib.sha256()
    for path in source_files(source_dir) + [source_dir / h for h in _HEADERS]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes() if path.is_file() else b"<missing>")
    for part in (CFLAGS, torch.__version__, sys.implementation.cache_tag, platform.machine(),
                 platform.system(), os.environ.get("CXX", "c++")):
        digest.update(repr(part).encode())
    return digest.hexdigest()[:16]


def _build_or_load(source_dir: Path, root: Path):
    name = f"grace_adam_{build_key(source_dir)}"
    build_dir = root / name
    library = build_dir / f"{name}.so"
    complete = build_dir / "build-complete"
    # A finished build is never written again (its marker is written last), so it loads without
    # the lock: a read-only cache that already holds it (a container image, a shared cluster) works.
    if complete.is_file() and library.is_file():
        return _import_library(name, library)
    with _exclusive(root, build_dir, root / f"{name}.lock"):
        if complete.is_file() and library.is_file():  # another process built it while we waited
            return _import_library(name, library)
        module = _build(name, source_dir, build_dir)
        complete.write_text(f"{library.name}\n")  # written last: a killed build leaves no marker
        return module


@contextmanager
def _exclusive(root: Path, build_dir: Path, lock_path: Path):
    # flock is released by the kernel when its holder dies, so a build killed halfway cannot leave
    # a lock that hangs the next process (torch's own `lock` file can; see _build).
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        handle = open(lock_path, "a")
    except OSError as error:
        raise KernelBuildError(
            f"Cannot build the GraceAdam host Adam kernel: the cache directory {root} is not writable "
            f"({type(error).__name__}: {error}). Set {CACHE_DIR_ENV} to a writable directory, or build the "
            f"kernel once where this cache is writable (later runs only read it).") from error
    with handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _build(name: str, source_dir: Path, build_dir: Path):
    from torch.utils import cpp_extension

    sources = source_files(source_dir)
    _check_toolchain(sources, cpp_extension)
    # We hold the flock, so no other process is building here: a `lock` baton file is a leftover
    # of a killed build, and torch would wait on it forever.
    (build_dir / "lock").unlink(missing_ok=True)
    # The build is silent and takes ~40 s on 2 cores: say what is happening, once per cache.
    print(f"[superoffload] building the GraceAdam host Adam kernel (first use; about 40 s on 2 cores) in "
          f"{build_dir}; it is cached there for later runs ({CACHE_DIR_ENV} moves the cache).",
          file=sys.stderr, flush=True)
    started = time.perf_counter()
    try:
        module = cpp_extension.load(name=name, sources=[str(s) for s in sources], extra_cflags=list(CFLAGS),
                                    build_directory=str(build_dir), verbose=False)
        print(f"[superoffload] built the host Adam kernel in {time.perf_counter() - started:.0f} s.",
              file=sys.stderr, flush=True)
        return module
    except Exception as error:  # torch raises RuntimeError with the compiler output; keep its tail
        detail = "\n".join(str(part) for part in (error, getattr(error, "output", None)) if part)
        tail = "\n".join(detail.splitlines()[-40:])
        raise KernelBuildError(f"Building the GraceAdam host Adam kernel in {build_dir} failed:\n{tail}\n"
                               "Check that g++ (>= 9) and ninja work, or use host_kernel='reference'.") from error


def _check_toolchain(sources: list, cpp_extension) -> None:
    missing = [str(s) for s in sources if not s.is_file()]
    if missing:
        raise KernelBuildError(f"The GraceAdam sources {missing} are missing: this installation of superoffload_hf "
                               "was built without them. Reinstall from a source checkout (`pip install .` or "
                               "`pip install -e .`) or from a wheel built by `pip wheel .`.")
    if not cpp_extension.is_ninja_available():
        raise KernelBuildError("Cannot build the GraceAdam host Adam kernel: ninja is not available. "
                               "Install it with `pip install ninja`.")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"Cannot build the GraceAdam host Adam kernel: no C++ compiler {compiler!r} "
                               "on PATH. Install g++ (e.g. `apt-get install g++`) or set CXX to one.")


def _import_library(name: str, library: Path):
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as error:
        raise KernelBuildError(f"Loading the GraceAdam kernel {library} failed: {error}. Delete "
                               f"{library.parent} to rebuild it.") from error
    return module
