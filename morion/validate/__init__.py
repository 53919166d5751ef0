"""`morion validate`: qualify any OpenAI-compatible deployment with frozen cases and kept evidence.

options.py (flags) -> run.py (orchestration) -> one module per suite: needle.py, restore.py, soak.py,
perf.py (bench's decode sweep and cold prefill), tools.py -> report.py / plot.py (Markdown, PNG). Beside
them: session.py (the server: endpoint, identity, /metrics, health), chat.py (streaming chat requests),
counting.py (prompt tokens as the server counts them), cases.py + cases/ (frozen case files).
"""
