"""What the compiled quantization passes need from inductor's CPU backend beyond its defaults (passes.py).

Two things, both set once per process before the first pass is compiled:

* **An on-disk cache per CPU.** Inductor's FX graph cache key does not include the vector ISA it generated code
  for, nor the host's instruction set (it compiles with ``-march=native``): a graph compiled under
  ``ATEN_CPU_CAPABILITY=avx2`` was loaded by a later unrestricted process and the other way round (found while
  emulating an AVX2-only CPU, bench/RESULTS-lowp.md), and a cache shared across machines (an NFS home, a volume
  mounted into containers on different hosts) would hand AVX-512 code to a CPU without it. Unless the user set
  ``TORCHINDUCTOR_CACHE_DIR``, the cache lives in a subdirectory of inductor's default named after the ISA and a
  hash of the CPU's flags.
* **Byte loads that do not stall on AVX2.** Inductor loads 8 one-byte codes per 8-lane fp32 vector with
  ``Vectorized<uint8_t>::loadu(ptr, 8)``; ATen's AVX2 version (torch 2.14) fills a 32-byte stack buffer, copies
  the 8 bytes over it and reloads it (a store-forwarding stall: 1.2 ns per element), while its AVX-512 version has
  a direct path for that count. The replacement builds the very same vector (the 8 bytes, the other 24 lanes set
  to 1 as ``loadu`` does) from one 8-byte load: a uint8 -> fp32 conversion pass over 512K codes took 0.65 ms
  compiled for AVX2, 0.05-0.07 ms with it (0.04-0.05 ms with AVX-512), and the Range EvoNorm backward pass of
  ResNet-20's first stage 6.2 -> 3.0 ms. Only kernels generated for AVX2 are affected; the passes' start-up
  bit-exactness check runs with it in place.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import torch

_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
_ONE_BYTE = (torch.uint8, torch.int8)
_QUARTER_OF_AVX2_BYTES = 8  # one fp32 vector's worth of one-byte lanes on AVX2 (a quarter of a 32-byte vector)
#: Part of the cache directory's name: changed whenever this module changes the code inductor generates, so graphs
#: cached without the change (the cache key does not see it) are not loaded.
_CODEGEN_TAG = "byte-loads-1"
_OWN_NAME = re.compile(r"[A-Za-z0-9_]+-[0-9a-f]{12}")  # per_cpu_cache_dir's subdirectory names


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The first CPU's feature flags line (what ``-march=native`` code depends on), '' where not readable."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def per_cpu_cache_dir(isa: str, flags: str) -> str:
    """Inductor's default cache directory with a subdirectory for this vector ISA, CPU flag set and code change."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    digest = hashlib.sha256(f"{flags} {_CODEGEN_TAG}".encode()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9_]+", "_", isa) or "scalar"  # the path goes into compiler command lines
    return str(Path(default_cache_dir()) / f"{name}-{digest}")


def use_per_cpu_cache() -> tuple[str, str]:
    """Point inductor's cache at :func:`per_cpu_cache_dir` unless the user set ``TORCHINDUCTOR_CACHE_DIR``; returns
    (the vector ISA inductor generates CPU code for here: "avx512", "avx2", "asimd", ... or "" for none, the cache
    directory). Importing inductor sets the variable to its default directory, so that value counts as unset, and so
    does one of this function's own directories inherited from a parent process."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    picked = pick_vec_isa()
    isa = str(picked) if picked else ""
    default = os.path.abspath(default_cache_dir())
    current = os.path.abspath(os.environ[_CACHE_ENV]) if os.environ.get(_CACHE_ENV) else ""
    # ours when inherited from a parent process that set it: recomputed, the child may run another ISA
    ours = bool(current) and os.path.dirname(current) == default and _OWN_NAME.fullmatch(os.path.basename(current))
    if current in ("", default) or ours:
        os.environ[_CACHE_ENV] = per_cpu_cache_dir(isa, cpu_flags())
    return isa, os.environ[_CACHE_ENV]


def avx2_byte_load(vec_type: str, address: str) -> str:
    """C++ expression: ``vec_type::loadu(address, 8)``'s vector (8 bytes from ``address``, lanes 8-31 set to 1),
    from one 8-byte load."""
    ones = "_mm_set1_epi8(1)"
    low = f"_mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>({address})), {ones})"
    return f"{vec_type}(_mm256_inserti128_si256(_mm256_set1_epi8(1), {low}, 0))"


def use_fast_byte_loads() -> bool:
    """Make inductor emit :func:`avx2_byte_load` for its AVX2 quarter-vector byte loads (module doc). False where
    this torch's code generator lacks the method or helpers it replaces (then nothing is changed)."""
    try:
        from torch._inductor import cpu_vec_isa
        from torch._inductor.codegen import cpp
    except ImportError:
        return False
    kernel = getattr(cpp, "CppVecKernel", None)
    original = getattr(kernel, "_get_vec_load_line", None)
    if original is None or not hasattr(cpp, "cexpr_index") or not hasattr(cpu_vec_isa, "VecAVX2"):
        return False
    if getattr(original, "fast_byte_loads", False):
        return True

    def load_line(self, var: str, index, dtype: torch.dtype, load_mask=None) -> str:
        if (load_mask is None and dtype in _ONE_BYTE and isinstance(self.vec_isa, cpu_vec_isa.VecAVX2)
                and self.num_elems == _QUARTER_OF_AVX2_BYTES):
            address = f"{var} + {cpp.cexpr_index(index)}" if index != 0 else var
            return avx2_byte_load(self._get_vec_type(dtype), address)
        return original(self, var, index, dtype, load_mask)

    load_line.fast_byte_loads = True
    kernel._get_vec_load_line = load_line
    return True
