"""Every Triton kernel's annotations are for the type checker only (`kernels/jit.py`): Triton
reads none of them as a parameter's type. A parameter annotated `int` or `float` would be
compiled as i32 or fp32 where an unannotated one is specialized by the value passed (i64 for a
stride past 2^31, 1 and multiples of 16 as their own cases). Read with Triton's own parser."""

import inspect

import pytest
from triton.runtime.jit import KernelParam

from radixrt.kernels import (
    causal_conv,
    decode_attention,
    extend_attention,
    fused_moe,
    gated_delta,
    lora_sgmv,
    packed_gemm,
    ssd,
)

MODULES = (
    causal_conv,
    decode_attention,
    extend_attention,
    fused_moe,
    gated_delta,
    lora_sgmv,
    packed_gemm,
    ssd,
)


def _kernels() -> list[tuple[str, object]]:
    """(module.name, the function) of every Triton function the modules define."""
    return [
        (f"{module.__name__.rpartition('.')[2]}.{name}", value.fn)
        for module in MODULES
        for name, value in vars(module).items()
        if inspect.isfunction(getattr(value, "fn", None)) and value.fn.__module__ == module.__name__
    ]


def test_every_kernel_module_has_triton_functions():
    found = {name.partition(".")[0] for name, _ in _kernels()}
    assert found == {m.__name__.rpartition(".")[2] for m in MODULES}


@pytest.mark.parametrize("name,fn", _kernels(), ids=[name for name, _ in _kernels()])
def test_triton_reads_no_annotation_as_a_parameter_type(name, fn):
    params = inspect.signature(fn).parameters.values()
    for i, param in enumerate(params):
        read = KernelParam(i, param, do_not_specialize=False, do_not_specialize_on_alignment=False)
        assert read.is_constexpr or not read.annotation_type, (
            f"{name}({param.name}: {param.annotation}) compiles as {read.annotation_type}"
        )
        assert read.annotation in ("constexpr", "tensor"), (name, param.name, param.annotation)
