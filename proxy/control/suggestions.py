"""Options a person must choose, journalled as suggestions with their reason and never applied.

:func:`suggest` reads a worker's facts (:class:`Facts`: its batches, its KV pool, its model's size) and
names the options of the tuning guide that change the engine's numbers or outputs
(:class:`~proxy.engines.base.Choice`: torch.compile, fp8 weights, an fp8 KV cache), each with the
engine's arguments for it (the engine contract's ``choice_args``) and why. On an engine the planner's
twin does not model (vLLM) it also names the levers the planner would price there: the CUDA graphs a
batch outgrew, chunked prefill switched off. The controller journals each one (rule ``suggestion``,
a note) at most once per :data:`SUGGEST_EVERY_S`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from proxy.control.decision import Action, Decision, RuleKind
from proxy.control.evidence import Evidence
from proxy.control.twin import Twin
from proxy.control.window import Window
from proxy.engines.base import Choice, Knob, KnobName
from proxy.sim.config import SimConfigError
from proxy.sim.presets import MIB

__all__ = ["SUGGEST_EVERY_S", "Facts", "Suggested", "Suggestion", "decisions", "facts_of", "suggest"]

SUGGEST_EVERY_S = 3600.0  # engine seconds between two journal entries of the same suggestion
TORCH_COMPILE_MAX_BS = 32  # SGLang's --torch-compile-max-bs default: compiled graphs cover batches up to it
SMALL_MODEL_PARAMS = 8.5e9  # the guide: torch.compile helps small models (8B and below)
FULL_POOL = 0.9  # token usage while requests wait at or above this: the KV pool is what limits the batch
HEAVY_WEIGHTS = 0.4  # weights over this share of the GPU memory: halving them is a much larger pool


@dataclass(frozen=True, slots=True, kw_only=True)
class Facts:
    """What a suggestion reads of one worker (None: not known)."""

    peak_running: int | None  # the largest running batch of the window
    waiting_usage: float | None  # KV pool usage while requests waited at the worker
    model: str  # the model the twin takes the worker for (a preset's name)
    model_params: float | None
    weights_share: float | None  # the weights over the GPU's memory


@dataclass(frozen=True, slots=True, kw_only=True)
class Suggested(Evidence):
    """A suggestion's figures: the option and the arguments that set it."""

    option: str
    suggested_args: str  # "name=value, ..." as the engine spells them
    peak_running: int | None = None
    waiting_usage: float | None = None
    model: str | None = None
    model_params_b: float | None = None


@dataclass(frozen=True, slots=True)
class Suggestion:
    option: str  # a Choice, or the knob a twin-less engine would have priced
    args: Mapping[str, object]  # what to set
    reason: str
    evidence: Suggested


def _spell(args: Mapping[str, object]) -> str:
    return ", ".join(f"{k}={v}" for k, v in args.items())


def _evidence(option: str, args: Mapping[str, object], f: Facts) -> Suggested:
    params = None if f.model_params is None else round(f.model_params / 1e9, 1)
    return Suggested(option=option, suggested_args=_spell(args), peak_running=f.peak_running,
                     waiting_usage=None if f.waiting_usage is None else round(f.waiting_usage, 2), model=f.model,
                     model_params_b=params)  # fmt: skip


def _choices(f: Facts, args: Mapping[str, object], choice_args: ChoiceArgs) -> list[Suggestion]:
    out: list[Suggestion] = []
    small = f.model_params is not None and f.model_params <= SMALL_MODEL_PARAMS
    if small and f.peak_running is not None and 0 < f.peak_running <= TORCH_COMPILE_MAX_BS:
        on = choice_args(Choice.TORCH_COMPILE, args)
        if on is not None:
            why = (f"small batches (at most {f.peak_running} running) and a small model ({f.model}): torch.compile "
                   "usually speeds up its decode steps; it lengthens every start and is yours to choose")  # fmt: skip
            out.append(Suggestion(Choice.TORCH_COMPILE, on, why, _evidence(Choice.TORCH_COMPILE, on, f)))
    full = f.waiting_usage is not None and f.waiting_usage >= FULL_POOL
    if full:
        on = choice_args(Choice.FP8_KV_CACHE, args)
        if on is not None:
            why = (f"the KV pool is full while requests wait ({f.waiting_usage:.0%} used): an fp8 KV cache holds "
                   "twice the tokens; it changes outputs slightly, so a person must choose it")  # fmt: skip
            out.append(Suggestion(Choice.FP8_KV_CACHE, on, why, _evidence(Choice.FP8_KV_CACHE, on, f)))
    if full and f.weights_share is not None and f.weights_share >= HEAVY_WEIGHTS:
        on = choice_args(Choice.FP8_WEIGHTS, args)
        if on is not None:
            why = (f"the KV pool is full while requests wait and the weights take {f.weights_share:.0%} of the GPU: "
                   "fp8 weights free half of that for the pool; outputs change, so a person must choose it")  # fmt: skip
            out.append(Suggestion(Choice.FP8_WEIGHTS, on, why, _evidence(Choice.FP8_WEIGHTS, on, f)))
    return out


def _twinless_levers(
    f: Facts, args: Mapping[str, object], knobs: Mapping[KnobName, Knob], choice_args: ChoiceArgs
) -> list[Suggestion]:
    """vLLM's levers the planner would price had it a twin of the engine: the CUDA graphs a batch
    outgrew, and chunked prefill where an operator switched it off."""
    out: list[Suggestion] = []
    graphs = knobs.get(KnobName.GRAPH_MAX_BS)
    if graphs is not None and graphs.default is not None and f.peak_running is not None:
        given = args.get(graphs.arg)
        now = int(given) if isinstance(given, int) and not isinstance(given, bool) else int(graphs.default)
        up = next((rung for rung in graphs.ladder if rung >= f.peak_running), None)
        if f.peak_running > now and up is not None and up > now:
            graph_on: dict[str, object] = {graphs.arg: int(up)}
            why = (f"the running batch reached {f.peak_running}, past the CUDA graphs captured up to {now}: "
                   f"decode steps past them run without a graph; capturing up to {up} takes more GPU memory "
                   "(the planner has no twin of this engine to price it)")  # fmt: skip
            out.append(Suggestion(KnobName.GRAPH_MAX_BS, graph_on, why, _evidence(KnobName.GRAPH_MAX_BS, graph_on, f)))
    on = choice_args(Choice.CHUNKED_PREFILL, args)
    if on is not None:
        why = ("chunked prefill is off: a long prompt's prefill stalls every running decode; with it on, "
               "the prefill chunk bounds each step")  # fmt: skip
        out.append(Suggestion(KnobName.PREFILL_CHUNK, on, why, _evidence(KnobName.PREFILL_CHUNK, on, f)))
    return out


ChoiceArgs = Callable[[Choice, Mapping[str, object]], "dict[str, object] | None"]


def suggest(
    f: Facts,
    args: Mapping[str, object],
    choice_args: ChoiceArgs,
    knobs: Mapping[KnobName, Knob],
    *,
    twin_prices_levers: bool,
) -> list[Suggestion]:
    """The suggestions ``f`` supports for a worker running ``args``: a person's choices, and on an
    engine whose levers the twin does not price (``twin_prices_levers`` False), those levers."""
    out = _choices(f, args, choice_args)
    if not twin_prices_levers:
        out += _twinless_levers(f, args, knobs, choice_args)
    return out


def facts_of(window: Window, twin: Twin, args: Mapping[str, object]) -> Facts:
    """A worker's facts: its window's batches and pool, its model's size as the twin's presets give it."""
    params = share = None
    try:
        cfg = twin.config(args)
        params, share = cfg.model.params, cfg.weights_bytes / (cfg.gpu.memory_mib * MIB)
    except SimConfigError:
        pass
    return Facts(peak_running=window.peak_running, waiting_usage=window.waiting_usage(), model=twin.model,
                 model_params=params, weights_share=share)  # fmt: skip


def decisions(worker_id: str, now: float, args: Mapping[str, object], found: list[Suggestion]) -> list[Decision]:
    """Each suggestion as a note for the journal (no restart: the arguments stay as they are)."""
    return [Decision(worker_id=worker_id, rule="suggestion", reason=f"suggest {_spell(s.args)}: {s.reason}",
                     time=now, evidence=s.evidence, old_args=args, new_args=args, action=Action.NOTE,
                     kind=RuleKind.TUNING) for s in found]  # fmt: skip
