"""`tailrl generate` on either engine: the run's sections and requests in, completions and the
stats line out, with the same fields whichever engine decoded.

Knows: how to open each engine for one generate call and read its counters. Does not know:
tokenizers, prompt files, text (tailrl.generate).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from tailrl.model import Transformer
from tailrl.rollout.protocol import Completion, Progress, Request


def summary_line(tokens: int, seconds: float, speculating: bool, accept_len: float, proposed: int, accepted: int,
             verify_steps: int, accept_hist: list[int]) -> dict[str, Any]:
    """generate's stats line, the same fields whichever engine decoded."""
    out: dict[str, Any] = {"tokens": tokens, "seconds": round(seconds, 4),
                           "tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0}
    if speculating:
        out.update(accept_len=round(accept_len, 3), proposed=proposed, accepted=accepted, verify_steps=verify_steps,
                   accept_hist=accept_hist)
    return out


def generate_native(c: dict[str, Any], model: Transformer, requests: list[Request],
                     stop: Callable[[list[int]], bool] | None,
                     progress: Callable[[Progress], None] | None) -> tuple[list[Completion], dict[str, Any]]:
    from tailrl.engine import Engine
    from tailrl.speculative.modes import install

    gen = c["generate"]
    engine = Engine(model, c["engine"])
    install(engine, c["speculation"], c["tuner"], seed=gen.seed)
    out = engine.generate(requests, c["sampling"], gen.max_new_tokens, stop=stop, on_progress=progress)
    st, sp = engine.stats, engine.stats.spec
    return out, summary_line(st.tokens, st.seconds, c["speculation"].spec != "off", sp.accept_len, sp.proposed,
                         sp.accepted, sp.verify_steps, sp.accept_hist)


def generate_vllm(c: dict[str, Any], model: Transformer, requests: list[Request],
                   progress: Callable[[Progress], None] | None) -> tuple[list[Completion], dict[str, Any]]:
    """The same requests on an in-process vLLM engine (tailrl.rollout.vllm, the T > 0 repair
    applied), drafting as [speculation] says with a tailrl drafter, an EAGLE export or a draft
    model; the drafter does not adapt (there is no training here)."""
    from tailrl.rollout.vllm.config import VllmRolloutConfig
    from tailrl.speculative.drafter.learner import AdaptConfig

    gen = c["generate"]
    rollout = VllmRolloutConfig(c["vllm"], c["speculation"], c["tuner"], AdaptConfig(adapt_drafter=False)).open(
        model, gen.seed)
    try:
        t0 = time.perf_counter()
        out = rollout.generate(0, requests, c["sampling"], gen.max_new_tokens, on_progress=progress)
        seconds, r = time.perf_counter() - t0, rollout.report()
    finally:
        rollout.close()
    tokens = sum(len(comp.token_ids) for comp in out)
    return out, summary_line(tokens, seconds, c["speculation"].spec != "off", r.spec_accept_len, r.spec_proposed,
                         r.spec_accepted, r.spec_verify_steps, r.accept_hist)
