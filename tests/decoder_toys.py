"""Tiny hand-built decoder-like ONNX models for decoder I/O and generation tests.

Each is a valid graph that ONNX Runtime runs in milliseconds and that behaves like a
decoder where it matters: ``present = concat(past, new)`` on the sequence axis, and
the logits at position t depend on every token <= t (a causal cumulative sum over the
present KV), on the position ids, on the mask length and on the GQA-style extras. So a
decode loop that feeds past, mask, positions or extras wrongly gives different tokens
than re-running the whole prefix.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

KV_NAMES: dict[str, Callable[[int], tuple[str, str, str, str]]] = {
    "hf": lambda l: (f"past_key_values.{l}.key", f"past_key_values.{l}.value",
                     f"present.{l}.key", f"present.{l}.value"),
    "flat": lambda l: (f"past_key_{l}", f"past_value_{l}", f"present_key_{l}", f"present_value_{l}"),
    "dot": lambda l: (f"past.{l}.key", f"past.{l}.value", f"present.{l}.key", f"present.{l}.value"),
    "underscore": lambda l: (f"past_key_values_{l}_key", f"past_key_values_{l}_value",
                             f"present_{l}_key", f"present_{l}_value"),
    # Names no heuristic places: only an io-map can.
    "opaque": lambda l: (f"kin{l}a", f"kin{l}b", f"kout{l}a", f"kout{l}b"),
}


def build_toy_decoder(path: Path, *, kv_names: str = "hf", layout: str = "bhsd", layers: int = 2,
                      heads: int = 2, head_dim: int = 4, vocab: int = 32,
                      ids_name: str = "input_ids", mask_name: str | None = "attention_mask",
                      pos_name: str | None = "position_ids", logits_name: str = "logits",
                      extras: tuple[str, ...] = (), past_seq_dim: str = "past_sequence_length",
                      present_seq_dim: str = "total_sequence_length",
                      symbolic_heads: bool = False, kv_dtype: int = TensorProto.FLOAT,
                      seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    hid = heads * head_dim
    inits, nodes = [], []

    def const(name: str, arr: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def node(op: str, ins: list[str], out: str, **attrs) -> str:
        nodes.append(helper.make_node(op, ins, [out], **attrs))
        return out

    def f32(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    inputs = [helper.make_tensor_value_info(ids_name, TensorProto.INT64, ["batch", "seq"])]
    h = node("Gather", [const("E", f32(vocab, hid)), ids_name], "h0")
    if pos_name:
        inputs.append(helper.make_tensor_value_info(pos_name, TensorProto.INT64, ["batch", "seq"]))
        h = node("Add", [h, node("Gather", [const("P", f32(256, hid, scale=0.5)), pos_name], "hp")], "h1")
    if "cache_position" in extras:
        inputs.append(helper.make_tensor_value_info("cache_position", TensorProto.INT64, ["seq"]))
        cp = node("Cast", [node("Unsqueeze", ["cache_position", const("ax02", np.array([0, 2], np.int64))],
                                "cp3")], "cpf", to=TensorProto.FLOAT)
        h = node("Add", [h, node("Mul", [cp, const("wcp", f32(hid, scale=0.05))], "cpw")], "h5")

    seq_axis = 2 if layout == "bhsd" else 1
    heads_dim = "kv_heads" if symbolic_heads else heads
    if layout == "bhsd":
        past_shape = ["batch", heads_dim, past_seq_dim, head_dim]
        present_shape = ["batch", heads_dim, present_seq_dim, head_dim]
    else:
        past_shape = ["batch", past_seq_dim, heads_dim, head_dim]
        present_shape = ["batch", present_seq_dim, heads_dim, head_dim]
    seq_len = node("Shape", [ids_name], "seq_len", start=1, end=2)
    neg_len = node("Neg", [seq_len], "neg_len")
    const("big", np.array([2**62], np.int64))
    const("seq_ax", np.array([seq_axis], np.int64))
    const("split4", np.array([0, 0, heads, head_dim], np.int64))
    const("flat3", np.array([0, 0, hid], np.int64))
    outputs = [helper.make_tensor_value_info(logits_name, TensorProto.FLOAT, ["batch", "seq", vocab])]
    for l in range(layers):
        pk, pv, ok, ov = KV_NAMES[kv_names](l)
        inputs += [helper.make_tensor_value_info(pk, kv_dtype, past_shape),
                   helper.make_tensor_value_info(pv, kv_dtype, past_shape)]
        outputs += [helper.make_tensor_value_info(ok, kv_dtype, present_shape),
                    helper.make_tensor_value_info(ov, kv_dtype, present_shape)]
        presents = []
        for kind, past_name, present_name in (("k", pk, ok), ("v", pv, ov)):
            new = node("Reshape", [node("MatMul", [h, const(f"W{kind}{l}", f32(hid, hid))], f"{kind}{l}mm"),
                                   "split4"], f"{kind}{l}r")
            if layout == "bhsd":
                new = node("Transpose", [new], f"{kind}{l}t", perm=[0, 2, 1, 3])
            if kv_dtype != TensorProto.FLOAT:
                new = node("Cast", [new], f"{kind}{l}c", to=kv_dtype)
            presents.append(node("Concat", [past_name, new], present_name, axis=seq_axis))
        kv = node("Add", presents, f"kv{l}")
        if kv_dtype != TensorProto.FLOAT:
            kv = node("Cast", [kv], f"kv{l}f", to=TensorProto.FLOAT)
        # Causal running mean over the sequence: position t sees positions <= t only.
        csax = const(f"csax{l}", np.array(seq_axis, np.int64))
        ones = node("ConstantOfShape", [node("Shape", [kv], f"kvs{l}")], f"ones{l}",
                    value=helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0]))
        cs = node("Div", [node("CumSum", [kv, csax], f"csum{l}"),
                          node("CumSum", [ones, csax], f"cnt{l}")], f"cs{l}")
        last = node("Slice", [cs, neg_len, "big", "seq_ax"], f"last{l}")
        if layout == "bhsd":
            last = node("Transpose", [last], f"last{l}t", perm=[0, 2, 1, 3])
        mix = node("Reshape", [last, "flat3"], f"mix{l}")
        h = node("Tanh", [node("Add", [h, mix], f"pre{l}")], f"hl{l}")
    # Mask length and GQA-style extras change only the outputs, never the KV (as in a
    # real decoder, where they say how much of the past to attend to).
    out_h = h
    if mask_name:
        inputs.append(helper.make_tensor_value_info(mask_name, TensorProto.INT64, ["batch", "total"]))
        msum = node("ReduceSum", [mask_name, const("ax1", np.array([1], np.int64))], "msum", keepdims=1)
        mf = node("Cast", [node("Unsqueeze", [msum, const("ax2", np.array([2], np.int64))], "m3")],
                  "mf", to=TensorProto.FLOAT)
        out_h = node("Add", [out_h, node("Mul", [mf, const("wm", f32(hid, scale=0.05))], "mw")], "o2")
    if "seqlens_k" in extras:
        inputs.append(helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]))
        sk = node("Cast", [node("Unsqueeze", ["seqlens_k", const("ax12", np.array([1, 2], np.int64))],
                                "sk3")], "skf", to=TensorProto.FLOAT)
        out_h = node("Add", [out_h, node("Mul", [sk, const("wsk", f32(hid, scale=0.05))], "skw")], "o3")
    if "total_sequence_length" in extras:
        inputs.append(helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []))
        tl = node("Cast", ["total_sequence_length"], "tlf", to=TensorProto.FLOAT)
        out_h = node("Add", [out_h, node("Mul", [tl, const("wtl", f32(hid, scale=0.05))], "tlw")], "o4")
    node("MatMul", [out_h, const("Wout", f32(hid, vocab, scale=2.0))], logits_name)

    graph = helper.make_graph(nodes, "toy_decoder", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def prefix_recompute_logits(runner, io, seq: np.ndarray) -> np.ndarray:
    """Last-position logits [batch, vocab] of ``seq`` [batch, T] run as one prefill with an
    empty past. Feeds are written here from their definitions, not by the code under test."""
    batch, total = seq.shape
    feeds = {io.input_ids.name: seq.astype(io.input_ids.dtype)}
    if io.attention_mask is not None:
        feeds[io.attention_mask.name] = np.ones((batch, total), io.attention_mask.dtype)
    if io.position_ids is not None:
        feeds[io.position_ids.name] = np.tile(np.arange(total), (batch, 1)).astype(io.position_ids.dtype)
    extra_values = {"seqlens_k": np.full(batch, total - 1), "total_sequence_length": np.array(total),
                    "cache_position": np.arange(total), "use_cache_branch": np.array([False])}
    for role, slot in io.extras.items():
        v = extra_values[role]
        feeds[slot.name] = (v.reshape(1) if slot.rank == 1 and v.ndim == 0 else v).astype(slot.dtype)
    for p in io.kv:
        for slot, dim in ((p.past_key, p.key_head_dim), (p.past_value, p.value_head_dim)):
            shape = (batch, p.kv_heads, 0, dim) if io.kv_layout == "bhsd" else (batch, 0, p.kv_heads, dim)
            feeds[slot.name] = np.zeros(shape, slot.dtype)
    logits = runner.run(feeds)[io.logits]
    return logits[:, -1, :] if logits.ndim == 3 else logits


def prefix_recompute_greedy(runner, io, prompt: np.ndarray, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy tokens [batch, tokens] without any KV reuse, and each step's top-2 margin."""
    seq = np.asarray(prompt, np.int64)
    out, margins = [], []
    for _ in range(tokens):
        logits = prefix_recompute_logits(runner, io, seq)
        top2 = np.sort(logits, axis=-1)[:, -2:]
        margins.append(top2[:, 1] - top2[:, 0])
        nxt = np.argmax(logits, axis=-1)
        out.append(nxt)
        seq = np.concatenate([seq, nxt[:, None]], axis=1)
    return np.stack(out, axis=1), np.stack(margins, axis=1)
