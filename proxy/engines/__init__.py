"""Everything specific to one inference engine lives here, behind one contract.

contract.py    the Engine protocol: what the rest of the proxy may ask of an engine
registry.py    ENGINES, the engines by the policy's name for them; EngineKind, the policy's vocabulary
base.py        the engine-neutral values engines produce: samples, log events, knobs, deaths
prometheus.py  the one Prometheus text reader (with a pre-filter of the series an engine reads) and the
               reader of an engine's fields from it (which series, how they combine, which are required)
flags.py       flag tables: checking, building and parsing command lines
sglang/        SGLang (and the simulator, which speaks it): argv, knobs, logs, metrics, engine
vllm/          vLLM's OpenAI server: argv, knobs, logs, metrics, engine

Nothing outside this package knows an engine's flag, metric name, log format or launcher.

Errors: as :mod:`proxy.engines.contract` says: a page that cannot be read raises
(``MetricsParseError``), "nothing to report" is ``None``, an argument's problem is returned in words.
"""
