"""The language-model roles: the compact model, its runner, prefill and decode engines, sampling,
logits processing, stopping and structured outputs."""
