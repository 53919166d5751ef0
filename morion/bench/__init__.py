"""`morion bench`: measurement against the roofline, offline or against any OpenAI-compatible server.

options.py (flags) -> run.py (orchestration) -> offline.py / remote.py / hf_baseline.py (targets) ->
workloads.py (decode sweep, prefill, TTFT) + restore.py (TTFT from the cache tiers) -> timing.py
(metrics) -> roofline.py + analysis.py (bounds, MBU, MFU) -> report.py / plot.py (JSON, Markdown, PNG);
provenance.py and prompts.py beside them; endpoint.py (reaching a server) is shared with `morion validate`.
"""
