"""The front door: OpenAI-compatible routes and SGLang's ``/generate`` (``handlers``), keys
(``auth``), request checks (``validation``), the model list (``models``), the proxy's own metrics and
status line (``metrics``, ``status_log``) and the state the handlers share (``state``).

It sits above the request path, the controller and the observers and below the composition root
(``proxy.compose``), which builds it. Every failure leaves it as an OpenAI-shaped ``ApiError``."""
