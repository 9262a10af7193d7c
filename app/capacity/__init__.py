"""Capacity planning: measure a worker (``profiler``), simulate a cluster in simulated time
with pdserve's own scheduler, block manager and routing policy (``simulator``), and search
prefill:decode splits against SLOs (``planner``). Everything but the profiler is pure."""
