"""The simulated SGLang engine (``pacer sim``): SGLang 0.5.23's flags, endpoints, logs and metrics,
and its scheduler's mechanics, without a GPU.

Modules, one job each:

* ``presets``, ``memory``, ``config``: GPU/model presets, SGLang's memory defaults and KV pool size,
  the resolved arguments (:func:`proxy.sim.cli.resolve_config` -> :class:`SimConfig`);
* ``engine``: the event loop: it advances virtual time and carries out what the parts decide;
* ``scheduler`` (with ``prefill_adder`` and ``ratio``): decides only: the waiting queue's order,
  SGLang's PrefillAdder admission, the new-token ratio, which requests to retract;
* ``kv_pool``, ``radix``, ``running``: the memory model (KV tokens, the prefix cache) and the
  running batch;
* ``steptime``, ``memory``: the execution-time model and activation memory (OOMs);
* ``reporter``: SGLang's log lines and counters;
* ``virtual``: :func:`simulate` a whole workload as fast as the CPU allows;
* ``driver``, ``generation``, ``startup``, ``server``, ``metrics``, ``logs``, ``protocol``,
  ``tokenizer``: the real-time HTTP server around the same core.

Times on the engine's clock are modelled seconds divided by ``--sim-time-scale``; throughput figures
(logs, ``/metrics``) are per second of that clock, i.e. per wall second when served over HTTP.
"""
