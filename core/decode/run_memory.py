"""A run's memory: estimated from its arguments and the decoder I/O, and admitted
against a budget before anything is allocated (docs/run.md, "Memory budget").

``estimate_run_memory(io, batch, prompt_len, tokens)`` counts what the decode loop
holds at its largest, from the shapes alone:

- the KV cache: batch x (prompt + tokens - 1) positions (a sliding-window cache: its
  capacity) x every layer's kv_heads x (key + value head dims) x the KV dtype, twice (a
  step's past and the present it produces are alive together);
- the prefill's outputs: logits batch x prompt x vocab (float32), and the attention
  scores batch x kv_heads x prompt x prompt (float32; a lower bound where the model
  has more query heads than KV heads); without KV inputs every step re-feeds the
  whole sequence, so both count the full length;
- the records: the prompt (batch x prompt int64), token ids, top-2 margins and logit
  ranges (batch x tokens x 8 bytes each) and the first step's logits (batch x vocab
  float32); all but the prompt twice with ``--compare``; with ``--logits-out`` every
  step's logits (batch x tokens x vocab float32) three times: kept, stacked, and in the
  file's buffer.

The model's weights are not counted: the prepared runtime bounds those itself
(docs/runtime.md). An unknown (symbolic) vocabulary counts as 0. Hidden and MLP
activations are not counted one by one: the decoder I/O does not give their widths,
and in a decoder LLM each is narrower than the logits counted above.

``admit(estimate, budget)`` raises ``UsageError`` naming the arguments and sizes when
the estimate is over the budget (the default budget and the sizes users write:
``core/runtime/memory_size.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

from onnx_prep.core.errors import UsageError
from onnx_prep.core.runtime.memory_size import format_size



@dataclass(frozen=True)
class RunMemory:
    """The estimate's parts in bytes and the arguments it came from."""

    batch: int
    prompt_len: int
    tokens: int
    layers: int
    kv_cache: int  # past and present together
    step_outputs: int  # the largest step's logits and attention scores
    records: int

    @property
    def total(self) -> int:
        return self.kv_cache + self.step_outputs + self.records

    def describe(self) -> str:
        return (f"batch {self.batch} x (prompt {self.prompt_len} + tokens {self.tokens}) needs "
                f"~{format_size(self.total)}: KV cache {format_size(self.kv_cache)} ({self.layers} layers), "
                f"step outputs {format_size(self.step_outputs)}, records {format_size(self.records)}")


def estimate_run_memory(io, batch: int, prompt_len: int, tokens: int, *, compare: bool = False,
                        keep_logits: bool = False) -> RunMemory:
    """The estimate for greedy-decoding ``tokens`` tokens on ``batch`` rows of
    ``prompt_len`` ids with the decoder I/O ``io`` (a ``DecoderIO``). Python integers
    throughout: no size overflows, nothing is allocated."""
    length = prompt_len + tokens - 1  # KV positions at the last step
    # a sliding-window cache holds its capacity from the first step, whatever the length
    kv_cache = 2 * batch * sum((p.capacity or length) * p.kv_heads * (
        p.key_head_dim * p.past_key.dtype.itemsize + p.value_head_dim * p.past_value.dtype.itemsize) for p in io.kv)
    vocab = io.vocab_size or 0
    fed = prompt_len if io.kv else length  # positions the largest step feeds
    heads = io.kv[0].kv_heads if io.kv else 0
    step_outputs = 4 * batch * fed * vocab + 4 * batch * heads * fed * fed
    records = 8 * batch * prompt_len + (3 * 8 * batch * tokens + 4 * batch * vocab) * (2 if compare else 1)
    if keep_logits:  # --logits-out: kept per step, stacked, then copied into the file's buffer
        records += 3 * 4 * batch * tokens * vocab
    return RunMemory(batch=batch, prompt_len=prompt_len, tokens=tokens, layers=len(io.kv),
                     kv_cache=kv_cache, step_outputs=step_outputs, records=records)


def admit(estimate: RunMemory, budget: int) -> None:
    """Raise ``UsageError`` (one line, naming the arguments and sizes) when the estimate
    is over ``budget`` bytes."""
    if estimate.total > budget:
        raise UsageError(f"the run does not fit the memory budget: {estimate.describe()}, over the budget of "
                         f"{format_size(budget)}",
                         hint="lower --batch, --tokens or the prompt length, or raise --memory-budget")
