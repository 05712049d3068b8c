"""The request path: from an accepted request to its one answer.

admission.py  the proxy's own queue (classes, FIFO within a class, bounded, deadlines)
pacing.py     per-worker load: the proxy's own in-flight count + the latest sample -> est. server queue
dispatch.py   the pacing gate, worker choice, and the attempt lifecycle
relay.py      queue -> dispatch -> open upstream -> relay bytes to the client
upstream.py   the proxy's own HTTP/1.1 client to the workers (keep-alive pool, back-pressure)
"""
