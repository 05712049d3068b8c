"""The simulated SGLang engine (``pacer sim``): SGLang 0.5.23's flags, endpoints, logs and metrics,
and its scheduler's mechanics, without a GPU.

Modules, one job each:

* ``presets``, ``memory``, ``config``: GPU/model presets, SGLang's memory defaults and KV pool size,
  the resolved arguments (:func:`proxy.sim.cli.resolve_config` -> :class:`SimConfig`);
* ``ratio``, ``scheduler``, ``radix``, ``steptime``, ``engine``: the new-token ratio, PrefillAdder-like
  admission, the prefix cache, the step-time model and the virtual-time scheduler core;
* ``virtual``: :func:`simulate` a whole workload as fast as the CPU allows;
* ``driver``, ``generation``, ``startup``, ``server``, ``metrics``, ``logs``, ``protocol``,
  ``tokenizer``: the real-time HTTP server around the same core.

Times on the engine's clock are modelled seconds divided by ``--sim-time-scale``; throughput figures
(logs, ``/metrics``) are per second of that clock, i.e. per wall second when served over HTTP.
"""
