"""Structured outputs on the worker: a request's grammar (`diptych_common.grammar.Grammar`) compiled once
per grammar text (`compiler.py`), a matcher per request that follows its tokens (`state.py`), and the
token masks applied to its logits before sampling (`masks.py`)."""
