"""benchmarks/sanitize.py's reading of compute-sanitizer's output: findings per kernel and per
driver phase, the summary total, and the tool's banner never counted as a finding."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("sanitize", ROOT / "benchmarks" / "sanitize.py")
sanitize = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sanitize)

CLEAN = """========= COMPUTE-SANITIZER
driver: toy-phi3-small triton padded
step: 0
driver: toy-phi3-small triton full
========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)
"""

FOUND = """========= COMPUTE-SANITIZER
driver: toy-llama triton padded
step: 0
========= Uninitialized __global__ memory read of size 2 bytes
=========     at _rope_kv_write_kernel+0x4c0 in /x/fullgraph/kernels/rope.py:38
=========     by thread (3,0,0) in block (1,0,0)
========= Uninitialized __global__ memory read of size 2 bytes
=========     at _rope_kv_write_kernel+0x4d0 in /x/fullgraph/kernels/rope.py:38
driver: toy-llama triton full
========= Uninitialized __global__ memory read of size 16 bytes
=========     at void at::native::vectorized_gather_kernel<16, long>(char*)+0x830
========= Uninitialized __global__ memory read of size 4 bytes
=========     at void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase &)::[lambda() (instance 3)]>(int, T1)+0x830
========= ERROR SUMMARY: 4 errors
"""


def test_the_banner_alone_is_no_finding():
    r = sanitize.parse(CLEAN)
    assert r["total"] == 0 and r["kernels"] == {} and r["phases"] == {}


def test_findings_counted_per_kernel_and_phase():
    r = sanitize.parse(FOUND)
    assert r["total"] == 4
    assert r["kernels"] == {"_rope_kv_write_kernel": 2, "at::native::vectorized_gather_kernel<16, long>": 1,
                            "at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda": 1}
    assert r["first_line"]["_rope_kv_write_kernel"] == "/x/fullgraph/kernels/rope.py:38"
    assert r["phases"] == {"toy-llama triton padded": {"_rope_kv_write_kernel": 2}, "toy-llama triton full": {"at::native::vectorized_gather_kernel<16, long>": 1,
                                                    "at::native::unrolled_elementwise_kernel<at::native::direct_c": 1}}
    assert list(r["kinds"]["_rope_kv_write_kernel"]) == ["Uninitialized __global__ memory read of size 2 bytes"]
