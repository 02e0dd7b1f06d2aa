"""Greedy decoding over any ``Runner`` (our prepared runtime session or ONNX Runtime).

The loop owns all mutable decode state: token ids, the attention mask and the KV
cache live here and are passed to the runner as feeds each step; the runner keeps
none of it (docs/design.md, "Plan template and inference submissions": caller
state travels with the run). Step 0 (prefill) feeds the whole prompt with an empty
past (sequence length 0); every later step feeds the one token chosen last, the
previous step's ``present`` outputs as ``past``, a mask of ones over past + new, and
the next position id.

Rows of a batch are independent prompts of the same length (no padding).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, runtime_checkable

import numpy as np

from onnx_prep.core.decode.decoder_io import DecoderIO
from onnx_prep.core.errors import ModelIOError, UsageError, Where
from onnx_prep.core.ops import append_buffer
from onnx_prep.core.option_ranges import MAX_TOKENS, check_range
from onnx_prep.core.runtime.stats import RuntimeStats


# The decode's counters, from the runner's RuntimeStats over the decode (a runner with
# ``stats()``: a Session), all 0 for a runner without (ORT): KV Concats appended in place /
# copied into a fresh buffer (core/ops/append_buffer.py); INT4 matmuls split over threads,
# the chunks the run's lent helpers ran, and how often a helper slept after 1 ms without a
# chunk and had to be woken (core/ops/intra_op.py). Each is a RuntimeStats field.
COUNTER_NAMES = ("kv_appended_in_place", "kv_copied", "matmul_splits", "chunks_by_helpers",
                 "helper_sleeps", "helper_wakes")


def _runner_stats(runner):
    """The runner's record now (core/runtime/stats.py), or None if it keeps none."""
    stats = getattr(runner, "stats", None)
    return stats() if callable(stats) else None


@runtime_checkable
class Runner(Protocol):
    """Runs one forward step. ``run`` maps input names to arrays and returns every
    output by name (at least the logits and each present KV). A runner holds no
    per-generation state (no KV cache); the arrays it returns belong to the caller,
    which feeds the presents back as the next step's past, so a runner must not
    reuse or mutate them after returning."""

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


@dataclass(frozen=True)
class StepEvent:
    """Passed to ``on_step`` after each step. ``logits`` are the last position's
    logits [batch, vocab] in the runner's dtype (a view: copy to keep)."""

    index: int  # 0 = prefill
    token_ids: np.ndarray  # int64 [batch]: the tokens chosen at this step
    logits: np.ndarray
    step_ms: float


@dataclass(frozen=True)
class GenerationResult:
    """Tokens and timings of one greedy decode.

    ``top2_margin`` and ``logit_range`` ([batch, tokens]) say how decisive each
    choice was: two correct implementations may pick different tokens where the
    margin is within their numerical tolerance.
    """

    prompt_ids: np.ndarray  # int64 [batch, prompt_len]
    tokens: np.ndarray  # int64 [batch, tokens]
    step_ms: tuple[float, ...]  # wall time of each step; [0] is the prefill (time to first output)
    top2_margin: np.ndarray  # float64 [batch, tokens]
    logit_range: np.ndarray  # float64 [batch, tokens]: max - min of the step's logits
    first_logits: np.ndarray | None = None  # float32 [batch, vocab]: the prefill's last position
    logits: tuple[np.ndarray, ...] | None = None  # per step [batch, vocab] when kept
    counters: Mapping[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTER_NAMES, 0))
    stats: RuntimeStats | None = None  # the runner's record over the decode (None: it keeps none)

    @property
    def batch(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def first_output_ms(self) -> float:
        return self.step_ms[0]

    @property
    def total_ms(self) -> float:
        return float(sum(self.step_ms))

    @property
    def decode_steps_per_s(self) -> float | None:
        """Decode steps (after the prefill) per second; each step emits one token per row."""
        decode_ms = sum(self.step_ms[1:])
        return (len(self.step_ms) - 1) / (decode_ms / 1e3) if decode_ms > 0 else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens emitted per second by the decode steps, all rows together."""
        s = self.decode_steps_per_s
        return None if s is None else s * self.batch

    @property
    def kv_appended_in_place(self) -> int:
        return self.counters["kv_appended_in_place"]

    @property
    def kv_copied(self) -> int:
        return self.counters["kv_copied"]

    def counters_json(self) -> dict:
        return dict(self.counters)

    def timings_json(self) -> dict:
        return {"first_output_ms": self.first_output_ms, "total_ms": self.total_ms,
                "decode_steps_per_s": self.decode_steps_per_s,
                "decode_tokens_per_s": self.decode_tokens_per_s, "step_ms": list(self.step_ms)}


def step_feeds(io: DecoderIO, new_ids: np.ndarray, past: Mapping[str, np.ndarray],
               past_len: int) -> dict[str, np.ndarray]:
    """Feeds for one step: ``new_ids`` [batch, n] after ``past_len`` cached tokens.

    ``past`` maps each past input name to its array (sequence length ``past_len``).
    Exposed for tests and for runners that drive their own loop.
    """
    batch, n = new_ids.shape
    total = past_len + n
    feeds = {io.input_ids.name: new_ids.astype(io.input_ids.dtype, copy=False)}
    if io.attention_mask is not None:
        feeds[io.attention_mask.name] = np.ones((batch, total), dtype=io.attention_mask.dtype)
    positions = np.arange(past_len, total, dtype=np.int64)
    if io.position_ids is not None:
        pos = positions if io.position_ids.rank == 1 else np.broadcast_to(positions, (batch, n))
        feeds[io.position_ids.name] = np.ascontiguousarray(pos, dtype=io.position_ids.dtype)
    for role, slot in io.extras.items():
        if role == "seqlens_k":
            value = np.full((batch,), total - 1)
        elif role == "total_sequence_length":
            value = np.array(total) if slot.rank == 0 else np.array([total])
        elif role == "cache_position":
            value = positions
        elif role == "use_cache_branch":
            value = np.array([past_len > 0])
        else:  # pragma: no cover - EXTRA_ROLES and this function change together
            raise AssertionError(role)
        feeds[slot.name] = value.astype(slot.dtype)
    feeds.update(past)
    return feeds


def _last_logits(io: DecoderIO, out: Mapping[str, np.ndarray], batch: int, model: str | None) -> np.ndarray:
    try:
        logits = out[io.logits]
    except KeyError:
        raise ModelIOError(f"runner returned no logits output {io.logits!r}", Where(model=model)) from None
    logits = np.asarray(logits)
    if logits.ndim == 3:  # [batch, seq, vocab]: the next token comes from the last position
        logits = logits[:, -1, :]
    if logits.ndim != 2 or logits.shape[0] != batch:
        raise ModelIOError(f"logits have shape {list(out[io.logits].shape)}; expected "
                           f"[{batch}, seq, vocab] or [{batch}, vocab]", Where(model=model, tensor=io.logits))
    return logits


def next_past(io: DecoderIO, out: Mapping[str, np.ndarray], expect_len: int,
              model: str | None = None) -> dict[str, np.ndarray]:
    """The next step's past inputs from a step's present outputs (checked: each holds
    ``expect_len`` positions, a sliding-window cache its capacity). Exposed, like
    :func:`step_feeds`, for runners that drive their own loop."""
    past = {}
    for p in io.kv:
        want = p.capacity or expect_len
        for present, slot in ((p.present_key, p.past_key), (p.present_value, p.past_value)):
            arr = out.get(present)
            if arr is None:
                raise ModelIOError(f"runner returned no present output {present!r}", Where(model=model))
            if arr.ndim != 4 or arr.shape[io.seq_axis] != want:
                raise ModelIOError(
                    f"present output has shape {list(arr.shape)}; expected sequence length "
                    f"{want} on axis {io.seq_axis} ({io.kv_layout})",
                    Where(model=model, tensor=present),
                    hint="the KV layout may be wrong: give kv_layout in --io-map FILE")
            past[slot.name] = arr if arr.dtype == slot.dtype else arr.astype(slot.dtype)
    return past


def greedy_decode(runner: Runner, io: DecoderIO, prompt_ids: np.ndarray, tokens: int, *,
                  on_step: Callable[[StepEvent], None] | None = None,
                  keep_logits: bool = False, model: str | None = None) -> GenerationResult:
    """Greedy-decode ``tokens`` tokens for each row of ``prompt_ids`` [batch, prompt_len].

    Runs ``tokens`` steps: the prefill emits the first token, each decode step one
    more. Ties in argmax go to the lowest id (numpy's rule). ``model`` is only for
    error messages. Raises ``UsageError`` for a bad prompt or count and
    ``ModelIOError`` when the runner's outputs do not fit ``io``.
    """
    prompt = np.asarray(prompt_ids)
    if prompt.ndim != 2 or prompt.shape[0] < 1 or prompt.shape[1] < 1:
        raise UsageError(f"prompt ids must be a non-empty [batch, prompt_len] array, got shape {list(prompt.shape)}")
    if not np.issubdtype(prompt.dtype, np.integer) or (prompt < 0).any():
        raise UsageError("prompt ids must be non-negative integers")
    check_range("--tokens", tokens, 1, MAX_TOKENS)  # the arrays below are batch x tokens
    if io.vocab_size is not None and (prompt >= io.vocab_size).any():
        raise UsageError(f"prompt id {int(prompt.max())} is outside the vocabulary (size {io.vocab_size})",
                         Where(model=model))
    prompt = prompt.astype(np.int64)
    batch, plen = prompt.shape

    out_tokens = np.zeros((batch, tokens), dtype=np.int64)
    margins = np.zeros((batch, tokens), dtype=np.float64)
    ranges = np.zeros((batch, tokens), dtype=np.float64)
    kept: list[np.ndarray] = []
    first_logits = None
    step_ms: list[float] = []

    past = io.empty_past(batch)
    new_ids, past_len = prompt, 0
    s0 = _runner_stats(runner)
    # KV buffers sized once for the whole decode (append buffers; no growth copies)
    with append_buffer.room_for(prompt.shape[1] + tokens - 1):
        for step in range(tokens):
            t0 = time.perf_counter()
            out = runner.run(step_feeds(io, new_ids, past, past_len))
            logits = _last_logits(io, out, batch, model)
            chosen = np.argmax(logits, axis=-1).astype(np.int64)
            if io.kv:
                past_len += new_ids.shape[1]
                past = next_past(io, out, past_len, model)
            step_ms.append((time.perf_counter() - t0) * 1e3)

            out_tokens[:, step] = chosen
            top2 = np.partition(logits, -2, axis=-1)[:, -2:] if logits.shape[-1] > 1 else None
            if top2 is not None:
                margins[:, step] = top2[:, 1].astype(np.float64) - top2[:, 0]
            ranges[:, step] = logits.max(axis=-1).astype(np.float64) - logits.min(axis=-1)
            if step == 0:
                first_logits = np.array(logits, dtype=np.float32, copy=True)
            if keep_logits:
                kept.append(np.array(logits, dtype=np.float32, copy=True))
            if on_step is not None:
                on_step(StepEvent(step, chosen, logits, step_ms[-1]))
            # Without KV inputs every step re-feeds the whole sequence (prefix recompute).
            new_ids = chosen[:, None] if io.kv else np.concatenate([new_ids, chosen[:, None]], axis=1)

    stats = _runner_stats(runner).since(s0) if s0 is not None else None
    return GenerationResult(prompt_ids=prompt, tokens=out_tokens, step_ms=tuple(step_ms),
                            top2_margin=margins, logit_range=ranges, first_logits=first_logits,
                            logits=tuple(kept) if keep_logits else None,
                            counters={k: getattr(stats, k) if stats is not None else 0 for k in COUNTER_NAMES},
                            stats=stats)


# A divergence where the reference's top-2 margin is within this fraction of its logit
# range is a near tie: two correct implementations may break it differently (random-
# weight models have many). Same scale as the logit tolerance of the oracle tests.
TIE_TOLERANCE = 1e-3


@dataclass(frozen=True)
class GenerationComparison:
    """``candidate`` against ``reference`` (e.g. the prepared runtime against ONNX Runtime)
    on the same prompt. ``near_tie`` is True when the first divergence happened where
    the reference's top-2 margin was at most ``TIE_TOLERANCE`` x its logit range."""

    identical: bool
    first_divergence_step: int | None
    first_divergence_row: int | None
    reference_margin: float | None  # the reference's top-2 margin at the divergence
    near_tie: bool
    first_step_max_abs_logit_diff: float
    first_step_logit_range: float

    @property
    def agrees(self) -> bool:
        """Identical, or diverged only at a near tie."""
        return self.identical or self.near_tie

    def to_json(self) -> dict:
        return dict(self.__dict__, agrees=self.agrees)


def compare_generations(candidate: GenerationResult, reference: GenerationResult, *,
                        tie_tolerance: float = TIE_TOLERANCE) -> GenerationComparison:
    if candidate.tokens.shape != reference.tokens.shape:
        raise UsageError(f"cannot compare generations of shapes {list(candidate.tokens.shape)} "
                         f"and {list(reference.tokens.shape)}")
    diff_first = np.abs(candidate.first_logits.astype(np.float64) - reference.first_logits)
    mismatch = np.argwhere(candidate.tokens != reference.tokens)
    step = row = margin = None
    near_tie = False
    if len(mismatch):
        # the earliest step; among rows diverging there, the one with the widest margin
        step = int(mismatch[:, 1].min())
        rows = mismatch[mismatch[:, 1] == step][:, 0]
        row = int(max(rows, key=lambda r: reference.top2_margin[r, step]))
        margin = float(reference.top2_margin[row, step])
        near_tie = margin <= tie_tolerance * float(reference.logit_range[row, step])
    return GenerationComparison(
        identical=not len(mismatch), first_divergence_step=step, first_divergence_row=row,
        reference_margin=margin, near_tie=near_tie,
        first_step_max_abs_logit_diff=float(diff_first.max()),
        first_step_logit_range=float(reference.logit_range[:, 0].max()))
