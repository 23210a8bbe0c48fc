"""The GPU check kit (`python3 -m scripts.gpu_check`, docs/gpu-check.md): what it leaves out of the wheels,
the Triton it pairs with torch, its refusal without a workspace, and the report `profile_cuda.py` makes of
a trace. No download, no GPU."""

from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from scripts import gpu_check
from scripts.gpu_check import __main__ as kit
from scripts.gpu_check import profile_cuda
from scripts.series.git import Layout, SeriesError

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", [
    "triton/backends/amd/lib/libtriton_amd_codegen.so",
    "triton/backends/nvidia/lib/cupti/libcupti.so.12",
    "triton/backends/nvidia/lib/cupti-blackwell/libnvperf_host.so",
    "triton/backends/nvidia/bin/ptxas-blackwell",
    "torch/bin/protoc-3.21.12.0",
    "torch/lib/libnvshmem_device.a",
])
def test_kit_leaves_out_what_a_cuda_step_never_loads(name: str) -> None:
    assert kit.DROPPED.match(name)


@pytest.mark.parametrize("name", [
    "torch/bin/torch_shm_manager",  # torch refuses to import without it
    "triton/backends/nvidia/bin/ptxas",
    "triton/backends/amd/compiler.py",  # Triton imports every backend its entry points name
    "torch/lib/libtorch_cuda.so",
    "torch/include/ATen/ATen.h",
])
def test_kit_keeps_what_torch_and_triton_load(name: str) -> None:
    assert not kit.DROPPED.match(name)


def test_triton_is_the_version_torch_requires(tmp_path: Path) -> None:
    wheel = tmp_path / "torch-9.9.0-cp312-cp312-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("torch-9.9.0.dist-info/METADATA", "Name: torch\nRequires-Dist: sympy>=1.13.3\n"
                   'Requires-Dist: triton~=3.9.0; platform_system == "Linux"\n')
    assert kit.triton_requirement(wheel) == "triton==3.9.0"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("torch-9.9.0.dist-info/METADATA", "Name: torch\n")
    with pytest.raises(SeriesError, match="names no triton version"):
        kit.triton_requirement(wheel)


def test_kit_needs_a_workspace(tmp_path: Path) -> None:
    (tmp_path / "patches").mkdir()
    (tmp_path / "patches" / "base.json").write_text((ROOT / "patches" / "base.json").read_text())
    with pytest.raises(SeriesError, match="scripts.series workspace"):
        kit.build(Layout(tmp_path))
    assert not (tmp_path / ".gpu").exists()


def test_device_script_parses() -> None:
    device = Path(gpu_check.__file__).parent / "device.sh"
    assert subprocess.run(["bash", "-n", str(device)]).returncode == 0


def test_report_counts_the_kernels_that_carry_a_scope(tmp_path: Path) -> None:
    def x(name: str, cat: str, ts: int, dur: int, tid: int = 1, **args: object) -> dict[str, object]:
        return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": tid, "ts": ts, "dur": dur, "args": args}

    scope = [{"type": "module", "attr": "lin", "path": "lin", "class": "Linear",
              "class_qualname": "torch.nn.Linear", "count": 0}]
    events = [x("ProfilerStep#3", "user_annotation", 0, 300),
              x("## Call CompiledFxGraph k ##", "cpu_op", 5, 90),
              x("triton_poi_fused_0", "cpu_op", 8, 9, call_hierarchy=scope),
              x("cuLaunchKernel", "cuda_driver", 10, 5, correlation=1),
              x("triton_poi_fused_0", "kernel", 20, 3, tid=7, correlation=1, call_hierarchy=scope),
              x("cuLaunchKernel", "cuda_driver", 22, 2, correlation=4),
              x("triton_tem_fused_addmm_0", "kernel", 25, 3, tid=7, correlation=4, call_hierarchy=scope),
              x("aten::mm", "cpu_op", 30, 20),
              x("cudaLaunchKernel", "cuda_runtime", 35, 5, correlation=2),
              x("sm90_xmma_gemm", "kernel", 60, 8, tid=7, correlation=2),
              # launched outside any graph call: an eager op
              x("cudaLaunchKernel", "cuda_runtime", 150, 5, correlation=3),
              x("vectorized_elementwise_kernel", "kernel", 160, 2, tid=7, correlation=3)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    report = profile_cuda.report(str(path))
    assert report["steps"] == 1 and report["graph_calls"] == 1
    assert report["device_kernels"] == [4, 2]
    assert report["graph_call_kernels"] == [3, 2]
    assert report["triton_device"] == [2, 2] and report["triton_host"] == [1, 1]
    assert report["triton_templates"] == [1, 1] and report["template_scopes"] == [("lin", 1)]
    assert report["aten_ops_in_graph_calls"] == [1, 0]
    assert report["unannotated_in_calls"] == [("sm90_xmma_gemm", 1)]
    assert report["sample"] == [("triton_poi_fused_0", "lin"), ("triton_tem_fused_addmm_0", "lin")]
