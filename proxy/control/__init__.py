"""The controller: SGLang's tuning guide, applied continuously and journaled.

    window.py      a bounded window of one worker's samples and log events, and the figures rules read
    evidence.py    what each rule decided on: one frozen value per rule, written flat into the journal
    decision.py    Decision (what a rule wants) and ControlState (what is remembered per worker)
    rules.py       pure rules over (window, state, settings), the gate (cool-down, budget, flip guard)
    journal.py     every decision with its evidence and outcome: JSON lines + GET /admin/decisions
    controller.py  the loop: observe, tick, revive dead workers, hand restarts to an actor; each worker
                   in one phase (phase.py), each concern a handler over one roster.py: revival.py (a
                   death), trials.py (a canary, an operator's trial), planning.py (the planner's
                   synchronous halves), outcomes.py (how an act turned out); ports.py (its protocols)
    rollout.py     the actor: rolling restart (the pool's DRAINING state, the dispatcher's take-back, the restart)

Only ``rollout.py`` touches the outside world (``proxy.compose`` wires the controller into ``pacer
serve``, passing it the engine's log reading, the pool's log tail, the proxy's backlog and the
actor); everything else is pure and is tested on recorded sample series and log excerpts
(``tests/control/fixtures``).

Errors: the pure parts (windows, rules, the gate, states) answer with values: a figure that cannot
be computed is None, a rule that does not apply returns None, a decision held back comes with the
gate's reason. They raise nothing on purpose. Exceptions are met only at the edges, where the
outside world fails: the actor's restart (caught in ``Controller.carry_out`` and journaled as
``failed``) and the journal's file (an append that fails is logged; the entry stays in memory).
"""
