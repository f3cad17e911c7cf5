"""``omni-bench``: a load generator for any OpenAI-compatible server (omnirelay's or vLLM's).

Where things are: :mod:`.cli` (arguments, summary, JSON, plots), :mod:`.datasets` (random and file
prompts), :mod:`.runner` (warm-up, passes, concurrency limit or Poisson arrivals), :mod:`.client`
(one streaming request, timed per chunk), :mod:`.sse` (the event-stream parser), :mod:`.metrics`
(percentiles, throughput, goodput), :mod:`.plots` (PNG), :mod:`.progress` (the stderr bar).
"""
