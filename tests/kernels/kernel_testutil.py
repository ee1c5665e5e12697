"""Shared by the kernel tests (a plain module: conftest files are not meant to be imported)."""
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch
import triton

# Compiled Triton on the GPU when there is one, the Triton interpreter on the CPU otherwise (see conftest.py).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape, (out.shape, ref.shape)
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


TOL = {torch.float16: 2e-3, torch.bfloat16: 1.2e-2}  # fp32 accumulation; error is the output rounding
# Triton's own disassembler, beside the ptxas it compiles with: what reads a kernel's SASS without a GPU
NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
CUOBJDUMP = os.path.join(os.path.dirname(NVDISASM), "cuobjdump")


def _sm90_call(helper: str, *args: object) -> object:
    """kernel_testutil.`helper`(*args) in a process of its own, without TRITON_INTERPRET (whose kernels cannot be
    compiled); skipped where this Triton has no NVIDIA backend tools."""
    if not os.path.exists(NVDISASM):
        pytest.skip("this Triton has no NVIDIA backend tools (nvdisasm)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([here, os.path.join(here, os.pardir, os.pardir, "src"),
                                         env.get("PYTHONPATH", "")])
    call = json.dumps(list(args))
    out = subprocess.run([sys.executable, "-c", f"import json, kernel_testutil as u; "
                          f"print(json.dumps(u.{helper}(*json.loads({call!r}))))"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


def sm90_loop(module: str, kernel: str, pointers: dict, constexprs: dict, num_warps: int,
              num_stages: int = 3) -> list[str]:
    """The SASS instructions of the K loop (the body of its one backward branch) of `module`.`kernel`, compiled for
    an H100 (sm_90) by the ptxas and nvdisasm that Triton ships: no GPU needed. pointers: argument -> Triton pointer
    type; every other argument not in `constexprs` is an i32 that, like every pointer, is specialized as a multiple
    of 16 (the decode shapes). An integer argument the runtime sees as 1 (a unit stride) is specialized to 1 by
    Triton: pass it in `constexprs`, else its loads compile unvectorized."""
    return _sm90_call("_loop_sass", module, kernel, pointers, constexprs, num_warps, num_stages)


def sm90_resident(module: str, kernel: str, pointers: dict, builds: list) -> list[int]:
    """Programs of `module`.`kernel` one sm_90 SM holds at once, for each build [constexprs, num_warps, num_stages]
    (compiled as sm90_loop's), from its registers per thread and shared memory."""
    return _sm90_call("_resident", module, kernel, pointers, builds)


def sm90_sass(module: str, kernel: str, pointers: dict, constexprs: dict, num_warps: int,
              num_stages: int = 3) -> list[str]:
    """The whole SASS listing (labels and instructions, as nvdisasm prints them) of `module`.`kernel`, compiled as
    sm90_loop's: for kernels with more than one loop."""
    return _sm90_call("_sass", module, kernel, pointers, constexprs, num_warps, num_stages)


def _compile_sm90(module: str, kernel: str, pointers: dict, constexprs: dict, num_warps: int, num_stages: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(module), kernel)
    while not isinstance(fn, triton.runtime.JITFunction):  # Autotuner / Heuristics -> JITFunction
        fn = fn.fn
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in constexprs}
    source = ASTSource(fn=fn, signature=signature, attrs=attrs,
                       constexprs={(names.index(n),): v for n, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def _read_cubin(compiled, tool: str, flag: str) -> str:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        return subprocess.run([tool, flag, path], capture_output=True, text=True, check=True).stdout


def _resident(module: str, kernel: str, pointers: dict, builds: list) -> list[int]:
    """sm_90's limits per SM: 64K registers, allocated per warp in 256s; 228 KiB of shared memory, 1 KiB of it
    reserved per block; 32 blocks; 64 warps."""
    out = []
    for constexprs, num_warps, num_stages in builds:
        compiled = _compile_sm90(module, kernel, pointers, constexprs, num_warps, num_stages)
        regs = int(re.search(r"REG:(\d+)", _read_cubin(compiled, CUOBJDUMP, "--dump-resource-usage")).group(1))
        warp_regs = -(-regs * 32 // 256) * 256
        out.append(min(65536 // warp_regs // num_warps, 233472 // (compiled.metadata.shared + 1024), 32,
                       64 // num_warps))
    return out


def _loop_sass(module: str, kernel: str, pointers: dict, constexprs: dict, num_warps: int,
               num_stages: int) -> list[str]:
    compiled = _compile_sm90(module, kernel, pointers, constexprs, num_warps, num_stages)
    sass = _read_cubin(compiled, NVDISASM, "-c").splitlines()
    labels = {m.group(1): i for i, line in enumerate(sass) if (m := re.match(r"^(\.L_x_\d+):", line))}
    back = [(labels[m.group(1)], i) for i, line in enumerate(sass)
            if (m := re.search(r"BRA `\((\.L_x_\d+)\)", line)) and labels.get(m.group(1), i) < i - 1]  # not the
    # kernel's closing self-branch
    assert len(back) == 1, f"expected one loop, found backward branches {back}"
    start, end = back[0]
    return [line.split("*/", 1)[1].strip() for line in sass[start:end] if re.match(r"^\s+/\*[0-9a-f]+\*/", line)]


def _sass(module: str, kernel: str, pointers: dict, constexprs: dict, num_warps: int, num_stages: int) -> list[str]:
    return _read_cubin(_compile_sm90(module, kernel, pointers, constexprs, num_warps, num_stages), NVDISASM,
                       "-c").splitlines()
