"""`benchmarks/gpu_program.py`: the kernels, bytes and matmul FLOPs read off an optimized XLA
HLO module (a small one in the text form XLA:GPU prints, written here)."""

from __future__ import annotations

import pytest

from benchmarks.gpu_program import _bytes, kernels, summary

# A logits matmul as a Triton gemm fusion, a tuple-shaped reduction over its output (with a
# nested reduction computation), a bitcast and a get-tuple-element (no kernels), a copy.
HLO = """HloModule jit_train_step, entry_computation_layout={(bf16[64,32]{1,0})->f32[64]{0}}

%region_0.1 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%a, %b)
}

%gemm_fusion_dot.7_computation (parameter_0: bf16[64,32], parameter_1: bf16[32,100]) -> bf16[64,100] {
  %parameter_0 = bf16[64,32]{1,0} parameter(0)
  %parameter_1 = bf16[32,100]{1,0} parameter(1)
  ROOT %dot.0 = bf16[64,100]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_reduce (param_0.1: bf16[64,100]) -> (f32[64], f32[64]) {
  %param_0.1 = bf16[64,100]{1,0} parameter(0)
  %convert.1 = f32[64,100]{1,0} convert(%param_0.1)
  %constant_0 = f32[] constant(0)
  %reduce.1 = f32[64]{0} reduce(%convert.1, %constant_0), dimensions={1}, to_apply=%region_0.1
  %multiply.1 = f32[64,100]{1,0} multiply(%convert.1, %convert.1)
  %reduce.2 = f32[64]{0} reduce(%multiply.1, %constant_0), dimensions={1}, to_apply=%region_0.1
  ROOT %tuple.1 = (f32[64]{0}, f32[64]{0}) tuple(%reduce.1, %reduce.2)
}

ENTRY %main.9 (args_0: bf16[64,32], args_1: f32[32,100]) -> f32[64] {
  %args_0 = bf16[64,32]{1,0} parameter(0)
  %args_1 = f32[32,100]{1,0} parameter(1)
  %wrapped_convert = bf16[32,100]{1,0} fusion(%args_1), kind=kLoop, calls=%wrapped_convert_computation, metadata={op_name="jit(train_step)/jvp(source_embedding)/convert_element_type"}
  %gemm_fusion_dot.7 = bf16[64,100]{1,0} fusion(%args_0, %wrapped_convert), kind=kCustom, calls=%gemm_fusion_dot.7_computation, metadata={op_name="jit(train_step)/jvp(decoder_layer_3)/output/dot_general"}, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %bitcast.1 = bf16[64,100]{1,0} bitcast(%gemm_fusion_dot.7)
  %input_reduce_fusion = (f32[64]{0}, f32[64]{0}) fusion(%bitcast.1), kind=kInput, calls=%fused_reduce, metadata={op_name="jit(train_step)/jvp(decoder_layer_5)/norm/reduce_sum"}
  %get-tuple-element.1 = f32[64]{0} get-tuple-element(%input_reduce_fusion), index=0
  ROOT %copy.1 = f32[64]{0} copy(%get-tuple-element.1)
}
"""


def test_each_kernel_reads_its_operands_writes_its_result_and_counts_its_dots():
    found = {kernel["name"]: kernel for kernel in kernels(HLO)}
    assert list(found) == ["wrapped_convert", "gemm_fusion_dot.7", "input_reduce_fusion",
                           "copy.1"]  # no kernel for parameters, bitcasts, tuple elements
    convert, gemm, reduce, copy = found.values()
    assert (convert["read"], convert["written"], convert["kind"]) == (32 * 100 * 4,
                                                                      32 * 100 * 2, "kLoop")
    assert gemm["read"] == 64 * 32 * 2 + 32 * 100 * 2 and gemm["written"] == 64 * 100 * 2
    assert gemm["flops"] == 2 * 64 * 100 * 32
    assert gemm["kind"] == "__triton_nested_gemm_fusion"
    # A bitcast's operand is its source's buffer: the gemm's output, 64 x 100 bf16.
    assert reduce["read"] == 64 * 100 * 2 and reduce["written"] == 2 * 64 * 4
    assert reduce["flops"] == 0 and reduce["kind"] == "kInput"
    assert (copy["read"], copy["written"], copy["kind"]) == (64 * 4, 64 * 4, "copy")


def test_the_summary_folds_layers_and_bounds_each_kernel_by_flops_or_bytes():
    report = summary(kernels(HLO), "h200", top=10)
    total = (32 * 100 * 6 + 64 * 32 * 2 + 32 * 100 * 2 + 64 * 100 * 2 + 64 * 100 * 2
             + 2 * 64 * 4 + 64 * 4 * 2)
    assert report["kernels"] == 4 and report["gb"] == pytest.approx(total / 1e9)
    assert report["matmul_tflop"] == pytest.approx(2 * 64 * 100 * 32 / 1e12)
    # Every kernel this small is bound by its bytes at 4.8 TB/s.
    assert report["lower_bound_ms"] == pytest.approx(total / 4.8e12 * 1e3)
    assert "jvp(decoder_layer_N)/norm/reduce_sum" in report["by_group"]
    assert report["by_kind"]["__triton_nested_gemm_fusion"]["kernels"] == 1


def test_a_cublas_call_counts_its_contraction_and_not_its_workspace():
    hlo = """ENTRY %main.2 (p0: bf16[4,64,32], p1: bf16[4,32,16]) -> bf16[4,64,16] {
  %p0 = bf16[4,64,32]{2,1,0} parameter(0)
  %p1 = bf16[4,32,16]{2,1,0} parameter(1)
  %custom-call.1 = (bf16[4,64,16]{2,1,0}, s8[33554432]{0}) custom-call(%p0, %p1), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(train_step)/jvp(encoder_layer_0)/self_attention/dot_general"}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["2"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":["0"],"rhs_batch_dimensions":["0"]},"epilogue":"DEFAULT"}}
  ROOT %get-tuple-element.1 = bf16[4,64,16]{2,1,0} get-tuple-element(%custom-call.1), index=0
}
"""
    [gemm] = kernels(hlo)
    assert gemm["kind"] == "__cublas$lt$matmul" and gemm["flops"] == 2 * 4 * 64 * 16 * 32
    assert gemm["read"] == (4 * 64 * 32 + 4 * 32 * 16) * 2
    assert gemm["written"] == 4 * 64 * 16 * 2  # the 32 MiB workspace left out


def test_element_types_are_sized_and_loops_refused():
    assert _bytes("(f8e4m3fn[16,4]{1,0}, s4[8]{0}, pred[3]{0})") == 64 + 4 + 3
    with pytest.raises(ValueError, match="unknown XLA element type"):
        _bytes("q7[4]{0}")
    looped = HLO.replace("ROOT %copy.1 = f32[64]{0} copy(%get-tuple-element.1)",
                         "ROOT %while.1 = f32[64]{0} while(%get-tuple-element.1), "
                         "condition=%region_0.1, body=%region_0.1")
    with pytest.raises(ValueError, match="while"):
        kernels(looped)
