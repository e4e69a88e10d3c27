"""Agentic RL: multi-turn rollouts with tools and environments (docs/agentic.md).

    yatt-hpc run configs/demo_tools_cpu.yaml --run-dir runs/demo_tools    # the tool-use demo

`loop` drives the turns on any engine, `calls` parses tool calls and renders tool turns through the chat
template, `tools` imports the configured tools and runs a turn's calls in a pool, `sandbox` (with
`sandbox_child`) is the built-in Python tool, `rollout_side` is what a rollout rank builds from `agent:`.
"""
