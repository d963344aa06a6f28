"""`branchspec serve`: an OpenAI-compatible HTTP server over one long-lived engine.

protocol.py   what a request body means (checked field by field) and the JSON we answer with
textstream.py which text a request's tokens have made so far, safe to stream
worker.py     the engine thread: continuous batching across HTTP requests
metrics.py    the Prometheus metrics
app.py        the routes: auth, queue limit, streaming, disconnects
server.py     building the server from command-line options; start-up and shutdown on signals
"""
