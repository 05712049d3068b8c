"""Everything that is specific to one inference engine lives in its own subpackage here.

The rest of the proxy (pacing, controller, supervisor) speaks only in the engine-neutral terms of
:mod:`proxy.engines.base`: samples, log events and knobs.
"""
