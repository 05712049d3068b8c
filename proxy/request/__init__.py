"""The request path: from an accepted request to its one answer.

job.py        what a validated request is (route, body, stream, model, prompt prefix)
admission.py  the proxy's own queue (classes, FIFO within a class, bounded, deadlines)
pacing.py     per-worker load: the proxy's open attempts + the latest sample -> est. server queue
attempt.py    a request's ticket (its place, from admission on) and its tries, one per worker
dispatch.py   the pacing gate, worker choice, and ``async with dispatcher.attempt(ticket)``, the one
              owner of an attempt's lifecycle (release always, requeue exactly when nothing was sent)
sse.py        reading a relayed event stream: when has output started
relay.py      queue -> dispatch -> open upstream -> relay bytes to the client
upstream.py   the proxy's own HTTP/1.1 client to the workers (keep-alive pool, back-pressure)
path.py       RequestPath: these parts together, as the front door and batch jobs use them

Errors: a failure before output is an ``AttemptFailed`` inside the attempt's block; what reaches the
client is an ``ApiError`` (``proxy.errors``).
"""
