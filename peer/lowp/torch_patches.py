"""Patches to torch's code generator, each named with the torch versions it was verified on; all switchable off.

One patch today, to inductor's C++ backend: **byte loads that do not stall on AVX2.** Inductor loads 8 one-byte codes
per 8-lane fp32 vector with ``Vectorized<uint8_t>::loadu(ptr, 8)``; ATen's AVX2 version fills a 32-byte stack buffer,
copies the 8 bytes over it and reloads it (a store-forwarding stall), while its AVX-512 version has a direct path for
that count. The replacement builds the very same vector (the 8 bytes, the other 24 lanes set to 1 as ``loadu`` does)
from one 8-byte load: about 10x faster on a uint8 -> fp32 conversion pass, 2x on the Range EvoNorm backward pass
(figures: docs/decisions/lowp-passes.md). Only kernels generated for AVX2 change; the passes' start-up bit-exactness
check runs with the patch in place.

It replaces a private method (``CppVecKernel._get_vec_load_line``), so it is applied only on the torch versions in
:data:`VERIFIED_TORCH` (major.minor), only where that method and the helpers it calls exist, and never with
``LPDL_TORCH_PATCHES=0``. Anywhere else inductor's own code runs: the same bits, slower on AVX2.
"""

from __future__ import annotations

import os

import torch

#: torch major.minor versions the patches were verified on (generated code inspected, compiled results bit-exact
#: against eager: tests/test_lowp_compiler_env.py). torch 2.14.1 on x86_64 is what scripts/setup.sh installs.
VERIFIED_TORCH = ("2.14",)
#: Environment switch: "0" leaves torch's code generator untouched.
ENV_SWITCH = "LPDL_TORCH_PATCHES"
_ONE_BYTE = (torch.uint8, torch.int8)
_QUARTER_OF_AVX2_BYTES = 8  # one fp32 vector's worth of one-byte lanes on AVX2 (a quarter of a 32-byte vector)
#: Part of inductor's cache directory name (compiler_env.py) while the patch is on: the cache key does not see the
#: change, so graphs generated without it are not loaded with it, nor the other way round. Bump it on any change.
_BYTE_LOADS_TAG = "byte-loads-1"


def enabled() -> bool:
    """Whether patches may be applied in this process: a verified torch version and not switched off."""
    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return os.environ.get(ENV_SWITCH, "") != "0" and version in VERIFIED_TORCH


def codegen_tag() -> str:
    """What the patches in force change in generated code, for inductor's cache directory name."""
    return _BYTE_LOADS_TAG if enabled() else "unpatched"


def avx2_byte_load(vec_type: str, address: str) -> str:
    """C++ expression: ``vec_type::loadu(address, 8)``'s vector (8 bytes from ``address``, lanes 8-31 set to 1),
    from one 8-byte load."""
    ones = "_mm_set1_epi8(1)"
    low = f"_mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>({address})), {ones})"
    return f"{vec_type}(_mm256_inserti128_si256(_mm256_set1_epi8(1), {low}, 0))"


def use_fast_byte_loads() -> bool:
    """Make inductor emit :func:`avx2_byte_load` for its AVX2 quarter-vector byte loads (module doc). False where
    the patches are off (:func:`enabled`) or this torch's code generator lacks the method or helpers it replaces
    (then nothing is changed)."""
    if not enabled():
        return False
    try:
        from torch._inductor import cpu_vec_isa
        from torch._inductor.codegen import cpp
    except ImportError:
        return False
    kernel = getattr(cpp, "CppVecKernel", None)
    original = getattr(kernel, "_get_vec_load_line", None)
    if kernel is None or original is None or not hasattr(cpp, "cexpr_index") or not hasattr(cpu_vec_isa, "VecAVX2"):
        return False
    if getattr(original, "fast_byte_loads", False):
        return True

    def load_line(self, var: str, index, dtype: torch.dtype, load_mask=None) -> str:
        if (load_mask is None and dtype in _ONE_BYTE and isinstance(self.vec_isa, cpu_vec_isa.VecAVX2)
                and self.num_elems == _QUARTER_OF_AVX2_BYTES):
            address = f"{var} + {cpp.cexpr_index(index)}" if index != 0 else var
            return avx2_byte_load(self._get_vec_type(dtype), address)
        return original(self, var, index, dtype, load_mask)

    setattr(load_line, "fast_byte_loads", True)  # the marker read above: patched once only
    kernel._get_vec_load_line = load_line
    return True
