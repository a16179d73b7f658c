"""`tokenmill bench`: a load generator and report for any OpenAI-compatible server.

It is a client: it talks HTTP (streaming chat or completion requests) and never imports the
engine, so the same command measures tokenmill, llama.cpp's `llama-server` or vLLM.

Modules, one noun each: `datasets` (what to send), `tokenizer` (token lengths for synthetic
prompts), `client` (one streamed request and its timings), `load` (when to send: concurrency,
Poisson, burst), `metrics` (percentiles, goodput, cost), `report` (terminal table, JSON),
`benchmark` (one `bench serve` run), `sweep` (a list of loads), `plot` (the Pareto frontier PNG),
`args` (the command-line flags; stdlib only so that `tokenmill --help` stays fast).

`simulate` (`bench simulate`) is the one module that is not a client: it replays a workload
against N replicas made of `core/`'s scheduler and a step-time model, on a simulated clock.
"""
