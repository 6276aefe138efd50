"""The OpenAI-compatible endpoint of a rollout worker: harness-owned episodes.

Two ways an episode runs in rlbus. Either rlbus owns the loop (`rollout_workers.agent`: it
generates, parses tool calls and runs them in the episode's sandbox), or a harness owns it
(mini-swe-agent, an in-house agent): the harness calls this endpoint with the episode's key
as its OpenAI API key, runs its own tools, and rlbus records every call's tokens
(`episodes`), serves them from the worker's engine (`server`), and reads the wire format
strictly (`wire`). Either way the trajectory is verified on the controlled side.
"""
