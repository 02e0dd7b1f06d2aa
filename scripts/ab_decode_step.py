"""Decode steps with one setting on and off, alternating every two steps in ONE session,
so that both see the same machine state, the same memory and the same KV lengths.

    .venv/bin/python scripts/ab_decode_step.py [--toggle streaming|panels|amx|bound-calls|attention-split]
        [--preset medium | --model PATH] [--batch 1] [--tokens 32] [--rounds 6] [--threads 2]
        [--prompt-tokens 8] [--json FILE]

--toggle:
  streaming        the INT4 GEMVs' non-temporal weight prefetch (native.set_weight_streaming;
                   docs/kernels.md "Weight streaming")
  panels           a one-row level-4 GEMV reading two panels side by side ("on", the
                   default) or one at a time (native.set_gemv_panels)
  amx              INT4 matmuls of several rows on AMX tiles, where the CPU has them
                   (native.set_amx; docs/kernels.md "AMX tiles")
  bound-calls      the ops a node binds once at compile (GroupQueryAttention's decode
                   step, the Skip norms: an op's ``bind``, core/runtime/action_program.py)
                   or the general op they stand in for ("off"), swapped in the session's
                   compiled actions
  attention-split  a decode step's attention sharing its units with the run's helpers
                   (core/ops/intra_op.py ``attention_split``) or on the caller alone

Each round decodes --tokens greedily from the same prompt; the prefill and the first
decode step are left out. Prints each setting's step wall time, min / median / max (ms),
and checks that every round's tokens are identical (the setting changes no bit). "on" is
the default. scripts/gemv_step_profile.py --compare streaming compares the
streaming in two sessions interleaved round by round. Run it alone: other work on the machine changes every figure.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from onnx_prep import native
from onnx_prep.core.decode.generation import greedy_decode
from onnx_prep.core.ops import intra_op
from onnx_prep.core.profile.machine_activity import MachineActivity, describe
from onnx_prep.core.runtime.session import Session
from gemv_step_profile import open_decoder  # this folder: sys.path[0] when run as a script


# --toggle: the setting, on (the default) or off, given the session
TOGGLES = {"streaming": lambda session: native.set_weight_streaming,
           "panels": lambda session: lambda on: native.set_gemv_panels(2 if on else 1),
           "amx": lambda session: native.set_amx,
           "bound-calls": lambda session: _bound_calls(session),
           "attention-split": lambda session: _attention_split}


_SPLIT_DEFAULT = intra_op.MIN_ATTENTION_SPLIT_BYTES


def _attention_split(on: bool) -> None:
    """A decode step's attention shares its units with the run's helpers (the default
    threshold, core/ops/intra_op.py) or runs on the caller alone."""
    intra_op.MIN_ATTENTION_SPLIT_BYTES = _SPLIT_DEFAULT if on else 1 << 62


def _bound_calls(session):
    """Switch each compiled action whose op was bound to its node (``fn.unbound``: the
    general op) between the two."""
    pairs = [(a, a.fn, a.fn.unbound) for a in session.program.actions if hasattr(a.fn, "unbound")]
    if not pairs:
        raise SystemExit("--toggle bound-calls: no action of this model has a bound call")

    def setting(on: bool) -> None:
        for action, bound, general in pairs:
            object.__setattr__(action, "fn", bound if on else general)  # Action is frozen
    return setting


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--toggle", choices=tuple(TOGGLES), default="streaming")
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--model", type=Path, help="a decoder model file instead of --preset")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=8,
                    help="the prompt's length (the context each decode step attends to starts there)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.tokens < 4:
        ap.error("--tokens must be at least 4 (the prefill and the first decode step are left out)")

    path, resolved, io, prompt = open_decoder(args.model, args.preset, args.batch)
    if args.prompt_tokens != prompt.shape[1]:  # the same ids, repeated to the length asked
        prompt = np.resize(prompt[0], args.prompt_tokens)[None, :].repeat(args.batch, axis=0)
    steps: dict[str, list[float]] = {"on": [], "off": []}

    tokens = None
    session = Session(resolved, cpu_workers=args.threads, intra_op_threads=args.threads)
    setting = TOGGLES[args.toggle](session)
    activity0 = MachineActivity.now()
    try:
        session.prepare()
        orun, step = session.run, [0]

        def run(feeds):
            i = step[0]
            step[0] += 1
            mode = ("on", "off")[(i // 2) % 2]
            setting(mode == "on")
            t = time.perf_counter()
            out = orun(feeds)
            if i >= 2:
                steps[mode].append((time.perf_counter() - t) * 1e3)
            return out

        session.run = run
        for _ in range(args.rounds):
            step[0] = 0
            got = greedy_decode(session, io, prompt, args.tokens).tokens.tolist()
            if tokens is not None and got != tokens:
                raise SystemExit("the greedy tokens differ between rounds: a setting changed the result")
            tokens = got
    finally:
        setting(True)
        session.close()
    activity = MachineActivity.now().since(activity0)
    print(f"{args.model or args.preset}: {args.toggle} on and off, {args.threads} threads, batch {args.batch}, "
          f"{args.rounds} rounds of {args.tokens} tokens, step wall ms min / median / max")
    for mode, v in steps.items():
        print(f"  {mode:10s} n={len(v):4d} {min(v):8.2f} {statistics.median(v):8.2f} {max(v):8.2f}")
    print(f"  median off / on: {statistics.median(steps['off']) / statistics.median(steps['on']):.3f}")
    print(describe(activity))
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model or args.preset), "toggle": args.toggle,
                                         "batch": args.batch,
                                         "threads": args.threads, "steps_ms": steps, "tokens": tokens,
                                         "machine_activity": activity}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
