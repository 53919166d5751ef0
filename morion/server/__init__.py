"""The OpenAI-compatible HTTP front end (`morion serve`): protocol, tokenization and chat templates,
streaming and metrics. The engine runs in its own process (`morion.server.engine_process`)."""
