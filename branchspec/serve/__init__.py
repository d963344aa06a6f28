"""`branchspec serve`: an OpenAI-compatible HTTP server over one long-lived engine.

fields.py     what one JSON field may hold (each refusal names the field)
protocol.py   what a request body means: prompts, samples and their SamplingParams
responses.py  the JSON we answer with: responses, stream chunks, logprobs
textstream.py which text a request's tokens have made so far, safe to stream
worker.py     the engine thread: continuous batching across HTTP requests
metrics.py    the Prometheus metrics
app.py        the routes: auth, queue limit, samples of a request, streaming, disconnects
server.py     building the server from command-line options; start-up and shutdown on signals
"""
