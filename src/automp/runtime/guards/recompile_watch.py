"""Never slower after the trial, too: a compiled path that keeps recompiling goes back to the eager path it beat.

A trial times a few iterations. A model whose graphs depend on its data recompiles later, as training moves it: the
zoo's Faster R-CNN (proposals, sampling and NMS) won its trial on automp's compiled graphs, then recompiled again and
again, seconds each time, until its iterations took many times as long on average as the hand-written eager loop's.
Dynamo's recompile limit ends that only after minutes, and then runs those frames uncompiled.

So each root on a compiled path keeps a balance once its verdict is in: the time its training calls spent compiling
again (the wall time of a call that compiled a graph; the backward's lazy compile is not counted, so the balance errs
towards keeping the path) against what the path saved, the verdict's measured lead over the fastest eager path times
the training calls since. Once it has recompiled `churn` times and the compiling cost more than it saved, the root
moves to that eager path, with the figures in its reason, and the cache remembers it, so the next run does not compile
at all. Recompiles in the first `quiet` training calls are the settling every compiled script goes through (a second
input length makes Dynamo's graph dynamic: a model trained on padded batches recompiles at its second and third
batch, then never) and are not counted; a few late ones (a last short batch) never reach `churn`; evaluation calls
(grad off) are not watched; and a lead that paid for the recompiles keeps the path.
"""
from __future__ import annotations

from dataclasses import dataclass

from automp.runtime.decisions import COMPILED_PATHS, EAGER_PATHS, RECOMPILES, Route, Verdict


@dataclass
class CompileWatch:
    """The balance of one root's compiled path since its verdict."""

    fallback: Route  # the fastest eager path the verdict measured
    lead_ms: float  # per iteration, the compiled path's measured lead over it
    churn: int = 3  # recompiling training calls before the path may be given up
    quiet: int = 10  # the first training calls, whose recompiles are the path settling, not churn
    recompiles: int = 0
    spent_s: float = 0.0  # wall time of the training calls that recompiled
    calls: int = 0  # training calls since the verdict

    def observe(self, compiled: bool, seconds: float) -> bool:
        """One training call (grad mode on) on the path; compiled: it compiled a graph, taking `seconds`. True when
        the path has cost more than it saved and should be given up."""
        self.calls += 1
        if compiled and self.calls > self.quiet:
            self.recompiles += 1
            self.spent_s += seconds
        return self.recompiles >= self.churn and self.spent_s > self.saved_s()

    def saved_s(self) -> float:
        return self.lead_ms * self.calls / 1e3

    def verdict(self, old: Verdict) -> Verdict:
        why = (f"{old.path.value} recompiled {self.recompiles} times between training calls {self.quiet} and "
               f"{self.calls} after the trial, {self.spent_s:.1f} s of compiling against {self.saved_s():.2f} s its "
               f"measured lead of {self.lead_ms:.2f} ms per iteration saved: its graphs depend on the data, so it "
               f"runs {self.fallback.value} (the trial had measured {_listed(old.timings_ms)})")
        return Verdict(self.fallback, why, dict(old.timings_ms), rule=RECOMPILES)


def watch_for(verdict: Verdict, churn: int) -> CompileWatch | None:
    """The watch over a verdict for a compiled path, or None: another path, or no eager path in its timings (a path
    forced by the configuration measured nothing), or churn <= 0 (off)."""
    if churn <= 0 or verdict.path not in COMPILED_PATHS or verdict.path.value not in verdict.timings_ms:
        return None
    eager = [p for p in EAGER_PATHS if p.value in verdict.timings_ms]
    if not eager:
        return None
    fallback = min(eager, key=lambda p: verdict.timings_ms[p.value])
    lead = verdict.timings_ms[fallback.value] - verdict.timings_ms[verdict.path.value]
    return CompileWatch(fallback, max(lead, 0.0), churn)


def _listed(timings: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f} ms" for k, v in sorted(timings.items(), key=lambda kv: kv[1]))
