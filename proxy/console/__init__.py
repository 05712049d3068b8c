"""Terminal commands that talk to a running proxy over HTTP: ``pacer status``, ``pacer decisions``
(its admin API) and ``pacer demo`` (a workload through its OpenAI API). They import nothing of the
proxy's runtime: what they know of it is what its endpoints answer."""
