"""Model-server simulator: vLLM/SGLang-like pods whose latency follows a GPU profile.

Public API: simulator.fleet.Fleet (in-process), simulator.cli.main (command line);
see docs/simulator.md.
"""
