"""The ``gqa`` kernel: com.microsoft GroupQueryAttention in C (core/ops/attention.py,
native/attention.c), with ONNX Runtime's CPU semantics (docs/ops.md).

Takes what the onnxruntime-genai model builder emits: separate or packed Q/K/V, past
and present KV in BNSH (growing, or at a fixed maximum length), ``seqlens_k`` /
``total_sequence_length``, rotary inside (``do_rotary``, interleaved or not), kv heads
fewer than query heads, any ``scale``, a sliding window (``local_window_size``), its
window-sized KV buffers (``sliding_window_cache``) and ``softcap`` (Gemma 2). No
prepared object: every input is an activation or a small cos / sin table read as it is.

Refused at resolve, one line naming the node, the attribute or input and the rule:
what ONNX Runtime itself rejects (num_heads not a multiple of kv_num_heads, do_rotary
without cos / sin caches, sliding_window_cache without a window or a past) and what
this kernel does not implement (smooth softmax, position_ids, attention_bias,
head_sink, the QK output).

Also runs ``onnx_prep.fused::Attention``, the causal attention over a KV cache that
pattern fusion makes of standard ops (core/model/attention_pattern.py), on the same C
kernel (core/ops/attention.py ``attention_with_past``), and ``onnx_prep.fused::MaskedAttention``
(any additive mask over caches a Concat extended, ``masked_attention``): any such node is
taken, as the fusion only makes what the op computes exactly.
"""
from __future__ import annotations

from onnx_prep.core.kernels.spec import KernelChoice, KernelSpec, MatchContext, node_input, refuse
from onnx_prep.core.model.fusion import FUSED_DOMAIN
from onnx_prep.core.model.transforms import GraphNode
from onnx_prep.core.ops import attention
from onnx_prep.core.ops.registry import MS_DOMAIN

ID = "gqa"
OP = (MS_DOMAIN, "GroupQueryAttention")
FUSED_OP = (FUSED_DOMAIN, "Attention")
MASKED_OP = (FUSED_DOMAIN, "MaskedAttention")

# Inputs past the nine the kernel reads: (position, name). ONNX Runtime derives position
# ids from seqlens_k when position_ids is absent, which is what the builder relies on.
_REFUSED_INPUTS = ((9, "position_ids"), (10, "attention_bias"), (11, "head_sink"))
# Attributes whose non-default value a kernel does not implement: (name, default, what).
# The device kernels (core/cuda/device_decoder_ops.py check_gqa_attributes) refuse every
# row; the CPU kernel implements those in _CPU_IMPLEMENTS (native/attention.c).
_REFUSED_ATTRIBUTES = (
    ("local_window_size", -1, "a sliding window (only -1, none, is implemented)"),
    ("softcap", 0.0, "softcap (only 0, none, is implemented)"),
    ("sliding_window_cache", 0, "window-sized KV buffers (only 0, none, is implemented)"),
    ("smooth_softmax", 0, "smooth softmax (only 0 is implemented)"),
    ("qk_output", 0, "the QK output (only 0, none, is implemented)"),
)
_CPU_IMPLEMENTS = frozenset({"local_window_size", "softcap", "sliding_window_cache"})

_CHOICE = KernelChoice(ID)


def match(node: GraphNode, ctx: MatchContext) -> KernelChoice:
    if (node.domain, node.op_type) in (FUSED_OP, MASKED_OP):
        return _CHOICE
    a = node.attributes
    n, kv = int(a.get("num_heads", 0)), int(a.get("kv_num_heads", 0))
    if n < 1 or kv < 1:
        raise refuse(node, f"num_heads {n} and kv_num_heads {kv} must both be set and positive")
    if n % kv:
        raise refuse(node, f"num_heads {n} is not a multiple of kv_num_heads {kv}")
    for name, default, what in _REFUSED_ATTRIBUTES:
        if name in a and a[name] != default and name not in _CPU_IMPLEMENTS:
            raise refuse(node, f"{name} = {a[name]}: {what}")
    if int(a.get("sliding_window_cache", 0)) not in (0, 1):
        raise refuse(node, f"sliding_window_cache = {a['sliding_window_cache']}: only 0 or 1")
    if int(a.get("sliding_window_cache", 0)) == 1:  # ONNX Runtime refuses both when the session is made
        if int(a.get("local_window_size", -1)) < 1:
            raise refuse(node, f"sliding_window_cache = 1 requires local_window_size > 0, got "
                               f"{a.get('local_window_size', -1)}")
        if not node_input(node, 3) or not node_input(node, 4):
            raise refuse(node, "sliding_window_cache = 1 requires past_key and past_value (inputs 3 and 4)")
        if len(node.outputs) < 3 or not node.outputs[1] or not node.outputs[2]:
            raise refuse(node, "sliding_window_cache = 1 requires the present_key and present_value outputs")
    for position, name in _REFUSED_INPUTS:
        if node_input(node, position):
            raise refuse(node, f"input {position} ({name}) is not implemented", node_input(node, position))
    if len([o for o in node.outputs if o]) > 3 or (len(node.outputs) > 3 and node.outputs[3]):
        raise refuse(node, "output 3 (output_qk) is not implemented")
    if (node_input(node, 1) is None) != (node_input(node, 2) is None):
        raise refuse(node, "key and value must be both present or both absent (packed QKV)")
    if (node_input(node, 3) is None) != (node_input(node, 4) is None):
        raise refuse(node, "past_key and past_value must be both present or both absent")
    if not node_input(node, 5) or not node_input(node, 6):
        raise refuse(node, "seqlens_k (input 5) and total_sequence_length (input 6) are required")
    if int(a.get("do_rotary", 0)) == 1 and not (node_input(node, 7) and node_input(node, 8)):
        raise refuse(node, "do_rotary = 1 needs cos_cache (input 7) and sin_cache (input 8)")
    return _CHOICE


SPEC = KernelSpec.of_table(ID, {OP: attention.group_query_attention, FUSED_OP: attention.attention_with_past,
                                MASKED_OP: attention.masked_attention}, match)
