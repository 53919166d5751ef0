"""Parsers of model output: reasoning (`<think>…</think>`) and tool calls, streamed or whole.

Both are driven by one streaming state machine (`TagScanner`), so a tag split across tokens or chunks
is held back until it is known, and a whole text fed at once gives the same result as any split of it.
"""
