"""The controller: SGLang's tuning guide, applied continuously and journaled.

    window.py      a bounded window of one worker's samples and log events, and the figures rules read
    decision.py    Decision (what a rule wants) and ControlState (what is remembered per worker)
    rules.py       pure rules over (window, state, settings), the gate (cool-down, budget, flip guard)
    journal.py     every decision with its evidence and outcome: JSON lines + GET /admin/decisions
    controller.py  the loop: observe, tick, revive dead workers, hand restarts to an actor
    rollout.py     the actor: rolling restart through the dispatcher's drain / take-back hooks

Only ``rollout.py`` touches the outside world (``proxy.compose`` wires the controller into ``pacer serve``); everything else is pure and is
tested on recorded sample series and log excerpts (``tests/control/fixtures``).
"""
